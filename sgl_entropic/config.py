"""The one configuration model of sgl-entropic: the mode and one section per control loop.

The signal itself has no knobs: the runtime measures exact entropy (one pass over the
vocabulary); the top-k estimator and its tail bounds are in sgl_entropic.signal for callers
that need them.

Server-wide values come from the launcher (`--entropic`, `--entropic-config`); a request may
override the sampling section with `sampling_params.custom_params.entropic = {...}`.
Every value is validated here, at the edge: unknown keys, NaN/inf, wrong types and
inconsistent bounds are errors that name the field, never silent clamps.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

ATTENTION_BACKEND = "entropic"  # the meso loop's attention backend, registered by the plugin

Mode = Literal["signal", "sampling", "scheduling", "pruning", "full"]
MODES: tuple[str, ...] = ("signal", "sampling", "scheduling", "pruning", "full")
# Old names still accepted: "off" never turned the signal off (it runs no loop and records the signal).
MODE_ALIASES = {"off": "signal"}

# The environment variable that carries the validated server config into every SGLang process
# (the scheduler and detokenizer are spawned, so they inherit the launcher's environment).
CONFIG_ENV = "SGLANG_ENTROPIC_CONFIG"
SERVER_ONLY = frozenset({"every_request"})  # sampling fields a request may not set
# custom_params.entropic.speculative: a request's speculation, not a sampling field. It crosses to the scheduler as
# custom_params.entropic_speculative (SGLang's IPC carries one level of nesting in custom_params).
REQUEST_SPECULATIVE_KEY = "speculative"
SPECULATIVE_PARAMS_KEY = "entropic_speculative"
# set by the HTTP process on a request that asked for its traces (`return_entropy`), which SGLang does not pass on
TRACES_PARAMS_KEY = "entropic_traces"
# SGLang server arguments whose KV paths bypass the attention backend, so the page store's key bounds
# would be stale or zero: pruning refuses them (plus PD disaggregation) until the store is fed there too.
KV_PATHS_PRUNING_CANNOT_SEE = {
    "enable_hierarchical_cache": "HiCache loads KV pages back from host memory",
    "enable_hisparse": "HiSparse offloads KV and runs its own sparse attention",
}


class _Section(BaseModel):
    # strict: a bool or a numeric string is a wrong type, not silently 1.0 / 0.3 (ints still pass as floats)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True, strict=True)


class SamplingConfig(_Section):
    """Micro loop: T_{t+1} = clip(T_t * exp(-eta * (H_t - H*)), t_min, t_max).

    Entropies are in nats, measured on the full temperature-scaled distribution
    (after penalties and grammar masks, before top-k/top-p/min-p truncation).
    """

    controller: Literal["entropic", "mirostat_v2"] = Field(
        "entropic",
        description="entropic: T steered so that H_t tracks H*; mirostat_v2: llama.cpp's Mirostat v2 "
        "(tokens above a surprise bound mu cut, mu steered to tau)",
    )
    target_entropy: float = Field(2.0, ge=0.0, le=20.0, description="H* in nats")
    eta: Optional[float] = Field(None, gt=0.0, le=10.0, description="gain; default 0.2 (entropic) or 0.1 (mirostat_v2)")
    t_init: Optional[float] = Field(
        None, gt=0.0, le=100.0, description="start temperature; default: the request's temperature"
    )
    t_min: float = Field(0.1, gt=0.0, le=100.0, description="lowest temperature the controller sets")
    t_max: float = Field(2.0, gt=0.0, le=100.0, description="highest temperature the controller sets")
    entropy_floor: float = Field(
        0.05, ge=0.0, le=20.0, description="below this H (nats) the step is forced: T is not updated"
    )
    warmup: int = Field(1, ge=0, le=10_000, description="first steps sampled at t_init, no update")
    tau: float = Field(5.0, gt=0.0, le=100.0, description="mirostat_v2 target surprise, in bits")
    # For clients and routers that cannot send custom_params (sglang-router 0.3.2 dropped it on /generate and chat).
    every_request: bool = Field(
        False, description="server only: sampled requests without custom_params.entropic get this controller too"
    )

    @model_validator(mode="after")
    def _bounds(self) -> "SamplingConfig":
        if self.t_min > self.t_max:
            raise ValueError(f"t_min ({self.t_min}) must be <= t_max ({self.t_max})")
        if self.t_init is not None and not self.t_min <= self.t_init <= self.t_max:
            raise ValueError(f"t_init ({self.t_init}) must lie in [t_min, t_max] = [{self.t_min}, {self.t_max}]")
        return self

    @property
    def gain(self) -> float:
        if self.eta is not None:
            return self.eta
        return 0.2 if self.controller == "entropic" else 0.1


class SchedulingConfig(_Section):
    """Macro loop: pi(s) = min(E[dH_s], max_gain) / (alpha*C_s + beta*M_s + gamma*L_s), with aging.

    Work units: one prefill token is one unit, one decode token `decode_weight` units. C is a
    request's expected remaining work and the scheduler's clock is the work served (identical on
    every tensor-parallel rank); `sgl_entropic/scheduling.py` defines each term.
    """

    order: Optional[Literal["entropic", "sglang"]] = Field(
        None,
        description="who orders the waiting queue and the decode retraction: entropic (pi with "
        "aging, SGLang's request priorities first), or sglang (its --schedule-policy / --retraction-policy); "
        "None: entropic in mode scheduling, sglang in mode full (there the entropic order did not beat "
        "SGLang's policies, docs/scheduling.md)",
    )
    alpha: float = Field(1.0, ge=0.0, le=1e6, description="weight of the remaining work C")
    beta: float = Field(1.0, ge=0.0, le=1e6, description="weight of KV pages held")
    gamma: float = Field(1.0, ge=0.0, le=1e6, description="weight of the latency slack")
    gain_ema: float = Field(0.8, ge=0.0, lt=1.0, description="EMA decay of observed entropy drops")
    max_gain: float = Field(
        1.0, gt=0.0, le=100.0, description="nats: every request starts at this E[dH] and is never credited more"
    )
    # 14: on a 2-core x86 CPU (fp32, SmolLM2-135M) a prefill token took 2.75 ms and a decode step of
    # 4 requests 148 ms, 37 ms per decode token (docs/scheduling.md); set it for other hardware.
    decode_weight: float = Field(
        14.0, gt=0.0, le=1e6, description="work units of one decode token (one prefill token is 1)"
    )
    expected_output_tokens: int = Field(
        256,
        ge=1,
        le=10_000_000,
        description="output expected of a request that may stop at EOS (capped by its max_new_tokens)",
    )
    max_wait: float = Field(
        8_000.0,
        gt=0.0,
        le=1e12,
        description="work units served after a request's arrival that make it overdue (then FIFO ahead of all others)",
    )
    decode_budget: Optional[int] = Field(None, ge=1, le=100_000, description="max requests decoded per step")
    max_skip_steps: int = Field(4, ge=1, le=10_000, description="a running request decodes at least every N steps")

    @model_validator(mode="after")
    def _weights(self) -> "SchedulingConfig":
        if self.alpha + self.beta + self.gamma == 0.0:
            raise ValueError("at least one of alpha, beta, gamma must be > 0")
        return self


class PruningConfig(_Section):
    """Meso loop: decode attends the sink and recent pages plus `keep` selected pages (sgl_entropic.pruning)."""

    selector: Literal["quest", "surprisal"] = Field(
        "quest",
        description="how candidate pages are scored: the query-aware key bound (then, with a shortlist, "
        "exact scores), or the tokens' surprisal (the paper's method, the same pages on every layer)",
    )
    page_size: int = Field(16, ge=1, le=1024, description="tokens per page; the server's KV --page-size")
    sink_blocks: int = Field(1, ge=0, le=1024, description="first pages, always attended")
    recent_blocks: int = Field(2, ge=1, le=1024, description="last pages, always attended")
    min_keep_ratio: float = Field(0.3, gt=0.0, le=1.0, description="share of candidate pages kept at H = 0")
    max_keep_ratio: float = Field(0.3, gt=0.0, le=1.0, description="share kept at H >= reference_entropy")
    shortlist_ratio: Optional[float] = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="share of candidates the bound shortlists for exact rescoring on their "
        "keys (>= max_keep_ratio); None: the bound picks the kept pages itself",
    )
    per_head: bool = Field(False, description="one page list per KV head instead of one per request")
    entropy_floor: float = Field(0.0, ge=0.0, le=20.0, description="below this H (nats) the budget stops shrinking")
    min_context: Optional[int] = Field(
        None,
        ge=0,
        le=10_000_000,
        description="shorter contexts attend everything; None: where pruning pays (CPU: timed once per machine "
        "and kept; CUDA: a rule measured on an H200)",
    )
    dense_kernel_from: Optional[int] = Field(
        None,
        ge=0,
        le=10_000_000,
        description="CPU: steps that do not prune run our kernel over every page from this context; None: timed "
        "once per machine and kept",
    )
    dense_layers: int = Field(0, ge=0, le=1024, description="the first layers attend everything")
    engaged: bool = Field(
        True,
        description="set by the launcher and the Engine: false in mode full on CUDA where the crossover rule "
        "never prunes (the two stages with min_context unset), and then SGLang's attention backend, prefill CUDA "
        "graphs and KV pool stay as stock has them; not a setting of its own",
    )
    aggregate: Literal["max", "mean", "sum"] = Field(
        "max", description="surprisal selector: page score from its tokens"
    )
    reference_entropy: Optional[float] = Field(
        None, gt=0.0, le=20.0, description="H_ref (nats) where the keep ratio reaches max; None: ln(V) / 2 of the model"
    )

    @model_validator(mode="after")
    def _ratios(self) -> "PruningConfig":
        if self.min_keep_ratio > self.max_keep_ratio:
            raise ValueError(
                f"min_keep_ratio ({self.min_keep_ratio}) must be <= max_keep_ratio ({self.max_keep_ratio})"
            )
        if self.shortlist_ratio is not None and self.shortlist_ratio < self.max_keep_ratio:
            raise ValueError(
                f"shortlist_ratio ({self.shortlist_ratio}) must be >= max_keep_ratio "
                f"({self.max_keep_ratio}): the kept pages come out of the shortlist"
            )
        return self


class SpeculativeConfig(_Section):
    """Under SGLang's NGRAM speculative decoding: how wide each verify step is (sgl_entropic/drafting.py).

    The maximum is SGLang's --speculative-num-draft-tokens; the controller and the traces follow every
    committed token whatever the rule.
    """

    algorithm: Optional[Literal["NGRAM"]] = Field(
        None,
        description="set by the launcher and the Engine from SGLang's --speculative-algorithm (None: no "
        "speculation); not a setting of its own",
    )
    source: Optional[str] = Field(
        None,
        description="set by the launcher and the Engine: why speculation is on or off (/server_info); not a "
        "setting of its own",
    )
    # The default follows the measurement (docs/speculative.md): with shadow trials the entropy rule led at batch 1.
    draft: Optional[Literal["off", "fixed", "matched", "acceptance", "entropy"]] = Field(
        None,
        description="verify width per step: fixed (SGLang's maximum), matched (what the trie offers), "
        "acceptance (SGLang's adaptive EMA rule), entropy (expected tokens per second from exp(-H), the "
        "request's own draft hit rate and this machine's step costs); off: no speculation (mode full turns "
        "NGRAM on by default); unset: entropy, or acceptance with --tp-size > 1 (the cost table is timed on each "
        "rank)",
    )
    drafts: Literal["request", "server"] = Field(
        "request",
        description="where drafts come from: request (each request's own n-gram trie over its prompt and "
        "output: its output never depends on what the server served before), server (SGLang's trie shared by every "
        "request's recent tokens)",
    )


class RequestSpeculation(_Section):
    """`custom_params.entropic.speculative`: one request's speculative decoding, within the server's."""

    draft: Optional[Literal["off", "fixed", "matched", "entropy"]] = Field(
        None,
        description="this request's draft rule: off (it verifies no drafts; alone it runs plain decode steps), "
        "fixed, matched or entropy (speculative.draft); unset: the server's",
    )
    max_draft_tokens: Optional[int] = Field(
        None,
        ge=0,
        description="at most this many of its drafts verified a step (up to "
        "--speculative-num-draft-tokens - 1); 0 is draft 'off'",
    )


class EntropicConfig(_Section):
    mode: Mode = "full"
    sampling: SamplingConfig = SamplingConfig()
    scheduling: SchedulingConfig = SchedulingConfig()
    pruning: PruningConfig = PruningConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()

    @model_validator(mode="before")
    @classmethod
    def _old_mode_names(cls, data):
        if isinstance(data, dict) and data.get("mode") in MODE_ALIASES:
            return {**data, "mode": MODE_ALIASES[data["mode"]]}
        return data

    @model_validator(mode="after")
    def _every_request_needs_sampling(self) -> "EntropicConfig":
        if self.sampling.every_request and not self.sampling_on:
            raise ValueError(f"sampling.every_request needs mode sampling or full, not {self.mode}")
        return self

    @property
    def sampling_on(self) -> bool:
        return self.mode in ("sampling", "full")

    @property
    def scheduling_on(self) -> bool:
        return self.mode in ("scheduling", "full")

    @property
    def entropic_order(self) -> bool:
        """Whether the macro loop's pi orders the queues (else SGLang's policies do)."""
        order = self.scheduling.order or ("entropic" if self.mode == "scheduling" else "sglang")
        return self.scheduling_on and order == "entropic"

    def with_queue_policies(
        self,
        schedule_policy: Optional[str],
        retraction_policy: Optional[str],
        spell=lambda name, value: f"--{name.replace('_', '-')} {value}",
    ) -> tuple[Optional[str], "EntropicConfig"]:
        """Who orders the queues, the user's choices first: (the schedule policy SGLang gets, the config).

        `entropic` (ours; SGLang's choices are fixed) is the macro loop's order over SGLang's fcfs, in
        mode scheduling or full. With the scheduling loop on, a schedule or retraction policy the user
        names is kept and the loop leaves both orders to SGLang (scheduling.order "sglang"; its decode
        budget still runs). Asking for two orders at once is a ValueError naming both, each as `spell`
        writes a (parameter, value) pair (the launcher's flags by default).
        """
        order = self.scheduling.order

        def ordered(by: str) -> "EntropicConfig":
            return self.model_copy(update={"scheduling": self.scheduling.model_copy(update={"order": by})})

        if schedule_policy == "entropic":
            asked = spell("schedule_policy", "entropic")
            if not self.scheduling_on:
                raise ValueError(f"{asked} needs the scheduling loop, but the entropic mode is {self.mode}")
            if order == "sglang":
                raise ValueError(f"{asked} contradicts scheduling.order 'sglang'")
            if retraction_policy is not None:
                raise ValueError(
                    f"{asked} orders the retraction too; drop {spell('retraction_policy', retraction_policy)}"
                )
            return "fcfs", ordered("entropic")
        named = [
            spell(name, value)
            for name, value in (("schedule_policy", schedule_policy), ("retraction_policy", retraction_policy))
            if value is not None
        ]
        if not self.scheduling_on or not named:
            return schedule_policy, self
        if order == "entropic":
            raise ValueError(f"{named[0]} and scheduling.order 'entropic' both order the queue: drop one of them")
        return schedule_policy, ordered("sglang")

    @property
    def speculative_on(self) -> bool:
        return self.speculative.algorithm is not None

    @property
    def pruning_on(self) -> bool:
        return self.mode in ("pruning", "full") and self.pruning.engaged

    @property
    def active_loops(self) -> list[str]:
        """What the runtime runs for this mode."""
        loops = (("sampling", self.sampling_on), ("scheduling", self.scheduling_on), ("pruning", self.pruning_on))
        return ["signal"] + [name for name, on in loops if on]

    def to_env(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_env(cls) -> Optional["EntropicConfig"]:
        """The server config, or None when this process was not started by our launcher."""
        raw = os.environ.get(CONFIG_ENV)
        return None if raw is None else cls.model_validate_json(raw)


def format_error(err: ValidationError, prefix: str = "") -> str:
    """One line per problem, each naming the field by its dotted path."""
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
        lines.append(f"{field or '<root>'}: {e['msg']}")
    return "; ".join(lines)


def parse_config_arg(value: str) -> dict[str, Any]:
    """`--entropic-config` takes inline JSON or a path to a JSON file."""
    text = value.strip()
    if not text.startswith("{"):
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"not inline JSON and not a file: {value!r}")
        text = path.read_text()
    data = json.loads(text, parse_constant=_reject_constant)
    if not isinstance(data, dict):
        raise ValueError("must be a JSON object")
    return data


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a valid number")


def request_sampling_config(server: SamplingConfig, overrides: Any) -> SamplingConfig:
    """Merge a request's `custom_params.entropic` object over the server's sampling section.

    Raises ValueError naming the field (the server turns it into HTTP 400).
    """
    if not isinstance(overrides, dict):
        raise ValueError(f"custom_params.entropic must be a JSON object, got {type(overrides).__name__}")
    server_only = sorted(SERVER_ONLY.intersection(overrides))
    if server_only:
        raise ValueError(
            f"custom_params.entropic.{server_only[0]}: a server setting (--entropic-config), not per request"
        )
    for key, value in overrides.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"custom_params.entropic.{key}: must be a finite number")
    try:
        return SamplingConfig.model_validate({**server.model_dump(exclude_unset=True), **overrides})
    except ValidationError as err:
        raise ValueError(format_error(err, prefix="custom_params.entropic")) from None


def request_speculation(
    value: Any, max_drafts: Optional[int], entropy_rule: bool, prefix: str = "custom_params.entropic.speculative"
) -> RequestSpeculation:
    """A request's `speculative` object checked against the server: `max_drafts` its most drafts a step (None:
    speculation is off there), `entropy_rule` whether its rule is entropy (it
    then has the cost table). ValueError naming the
    field (HTTP 400)."""
    if not isinstance(value, dict):
        raise ValueError(f"{prefix} must be a JSON object, got {type(value).__name__}")
    try:
        spec = RequestSpeculation.model_validate(value)
    except ValidationError as err:
        raise ValueError(format_error(err, prefix=prefix)) from None
    if spec.draft not in (None, "off") and max_drafts is None:
        raise ValueError(f"{prefix}.draft: speculative decoding is off on this server ('off' is the only rule)")
    if spec.draft == "entropy" and not entropy_rule:
        raise ValueError(
            f"{prefix}.draft: 'entropy' needs the server's cost table, timed where the server's rule is "
            "entropy (its default with --tp-size 1)"
        )
    if spec.max_draft_tokens is not None and max_drafts is not None and spec.max_draft_tokens > max_drafts:
        raise ValueError(
            f"{prefix}.max_draft_tokens: at most {max_drafts} on this server (--speculative-num-draft-tokens - 1)"
        )
    return spec
