"""SGLang server arguments against the entropic config: one set of rules for the launcher and the Engine.

`pruning_args` and `speculative_args` take SGLang's flags as the user gave them (field name -> value,
absent flags missing) and return the arguments the plugin sets (`speculative_args` also the config that
records them); anything it cannot serve correctly is a ValueError naming the flag, as `spell` writes it
(launcher: `--flag value`, Engine: `name=value`).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from sgl_entropic.config import ATTENTION_BACKEND, KV_PATHS_PRUNING_CANNOT_SEE, EntropicConfig
from sgl_entropic.crossover import cuda_can_prune

Spell = Callable[[str, Any], str]

# flag -> (its neutral value, why the plugin refuses any other)
REFUSED_WITH_SPECULATION = {
    "speculative_adaptive": (
        False,
        "SGLang's adaptive steps serve EAGLE only; speculative.draft 'acceptance' is its rule on NGRAM",
    ),
    "speculative_accept_threshold_single": (1.0, "a relaxed (lossy) acceptance"),
    "speculative_accept_threshold_acc": (1.0, "a relaxed (lossy) acceptance"),
    "speculative_use_rejection_sampling": (
        False,
        "n-gram drafts carry no draft probabilities; verification is exact already",
    ),
    "speculative_use_block_verification": (
        False,
        "n-gram drafts carry no draft probabilities; verification is exact already",
    ),
    "speculative_attention_mode": ("prefill", "verification attends as an extend (the default)"),
}
# KV cache dtypes whose keys the page store bounds as written (fp8/fp4 caches have no min/max kernels there,
# and a bound over quantized codes is not a bound over the dequantized keys)
PLAIN_KV_DTYPES = (None, "auto", "bf16", "bfloat16")
# flag -> (its neutral value, why pruning cannot serve any other)
REFUSED_WITH_PRUNING = {
    "enable_dp_attention": (
        False,
        "the backend decides graph or eager per rank, where DP attention needs one decision across ranks",
    ),
    "attn_dp_size": (
        1,
        "the backend decides graph or eager per rank, where DP attention needs one decision across ranks",
    ),
    "dcp_size": (
        1,
        "decode context parallelism splits a request's KV pages across ranks; the page plan is per request",
    ),
    "pp_size": (1, "the page store numbers layers from 0, a pipeline stage holds only its own"),
}
PRUNING_FIELDS = (
    "attention_backend",
    "page_size",
    "disaggregation_mode",
    "kv_cache_dtype",
    "disable_prefill_cuda_graph",
    "cuda_graph_backend_prefill",
    *KV_PATHS_PRUNING_CANNOT_SEE,
    *REFUSED_WITH_PRUNING,
)


def pruning_args(
    config: EntropicConfig, args: Mapping[str, Any], device: str, spell: Spell
) -> tuple[EntropicConfig, dict[str, Any]]:
    """(the config with pruning.engaged set, SGLang arguments pruning sets): the entropic attention backend over
    KV pages of pruning.page_size tokens (a selected page is one physical page), and on CUDA no prefill CUDA
    graphs (a replayed extend skips the backend's metadata step, where deferred page bounds are folded before
    new keys land); ValueError for what would go stale, bypass the page bounds, or split what the plan needs
    whole. In mode full on CUDA, where the crossover rule never prunes, nothing: stock's backend, graphs and pool."""
    if not config.pruning.engaged:
        raise ValueError(
            "pruning.engaged is set by the launcher from the device and the crossover rule, not the entropic config"
        )
    if not config.pruning_on:
        return config, {}
    cfg = config.pruning
    if device == "cuda" and config.mode == "full" and not cuda_can_prune(cfg.shortlist_ratio, cfg.min_context):
        return config.model_copy(update={"pruning": cfg.model_copy(update={"engaged": False})}), {}
    mode, updates = f"--entropic {config.mode}", {}
    backend = args.get("attention_backend")
    if backend is None:
        updates["attention_backend"] = ATTENTION_BACKEND
    elif backend != ATTENTION_BACKEND:
        raise ValueError(
            f"{mode} prunes attention in the {ATTENTION_BACKEND!r} backend; drop "
            f"{spell('attention_backend', backend)} (or use --entropic sampling|scheduling)"
        )
    page_size = args.get("page_size")
    if page_size is None:
        updates["page_size"] = config.pruning.page_size
    elif int(page_size) != config.pruning.page_size:
        raise ValueError(
            f"{spell('page_size', page_size)} differs from pruning.page_size {config.pruning.page_size}; "
            f'set them equal (--entropic-config \'{{"pruning": {{"page_size": {page_size}}}}}\')'
        )
    for name, why in KV_PATHS_PRUNING_CANNOT_SEE.items():
        if args.get(name):
            raise ValueError(
                f"{mode} prunes from page bounds written with the KV, and {spell(name, True)} bypasses "
                f"them ({why}); drop it or use --entropic sampling|scheduling"
            )
    disaggregation = args.get("disaggregation_mode")
    if disaggregation not in (None, "null"):
        raise ValueError(
            f"{mode} prunes from page bounds written with the KV, and "
            f"{spell('disaggregation_mode', disaggregation)} transfers KV between servers without them; "
            "drop one (or use --entropic sampling|scheduling)"
        )
    for name, (neutral, why) in REFUSED_WITH_PRUNING.items():
        if name in args and args[name] not in (None, neutral):
            raise ValueError(
                f"{spell(name, args[name])} with {mode}: not served ({why}); drop it or use "
                "--entropic sampling|scheduling"
            )
    if args.get("kv_cache_dtype") not in PLAIN_KV_DTYPES:
        raise ValueError(
            f"{spell('kv_cache_dtype', args['kv_cache_dtype'])} with {mode}: the page store bounds "
            "keys as written, and a quantized cache's codes give no bound on its keys; use a bf16 "
            "cache or --entropic sampling|scheduling"
        )
    if device == "cuda":
        p = config.pruning.page_size
        if p & (p - 1):
            raise ValueError(f"pruning.page_size {p} on CUDA: the Triton page kernels need a power of two")
        prefill_graphs = args.get("cuda_graph_backend_prefill")
        if prefill_graphs not in (None, "disabled"):
            raise ValueError(
                f"{spell('cuda_graph_backend_prefill', prefill_graphs)} with {mode}: a replayed "
                "prefill skips the step where the page store folds deferred bounds before new keys "
                "are written; drop it (decode CUDA graphs stay on)"
            )
        if not args.get("disable_prefill_cuda_graph"):
            updates["disable_prefill_cuda_graph"] = True
    return config, updates


# Attention backends with a verify forward on CPU (torch_native has none: ours adds it).
CPU_VERIFY_BACKENDS = (ATTENTION_BACKEND, "intel_amx")


def speculative_args(
    config: EntropicConfig, args: Mapping[str, Any], device: str, spell: Spell
) -> tuple[EntropicConfig, dict[str, Any]]:
    """(the config with speculative.algorithm set, SGLang arguments to add); ValueError for what is refused."""
    if config.speculative.algorithm is not None or config.speculative.source is not None:
        raise ValueError(
            "speculative.algorithm and speculative.source are set by the launcher and the Engine, not "
            "the entropic config"
        )
    algorithm, off = args.get("speculative_algorithm"), config.speculative.draft == "off"
    updates: dict[str, Any] = {}
    if algorithm is None:
        why_not = "speculative.draft 'off'" if off else default_blocker(config, args, spell)
        if config.mode != "full" or why_not is not None:
            source = None if config.mode != "full" else f"off: {why_not}"
            return config.model_copy(
                update={"speculative": config.speculative.model_copy(update={"source": source})}
            ), {}
        algorithm = updates["speculative_algorithm"] = "NGRAM"
        asked, source = "--entropic full", "on: the default of --entropic full (speculative.draft 'off' turns it off)"
    else:
        asked = spell("speculative_algorithm", algorithm)
        source = f"on: {asked}"
        if off:
            raise ValueError(f"{asked} with speculative.draft 'off': drop one of them")
    if str(algorithm).upper() != "NGRAM":
        raise ValueError(
            f"{asked}: sgl-entropic serves SGLang's NGRAM speculative decoding only (its verification "
            f"is where the controller and the traces run; {algorithm}'s would skip them)"
        )
    for name, (neutral, why) in REFUSED_WITH_SPECULATION.items():
        if name in args and args[name] != neutral:
            raise ValueError(f"{spell(name, args[name])} with {asked}: not served ({why})")
    if config.sampling.controller == "mirostat_v2":
        raise ValueError(
            f"sampling.controller 'mirostat_v2' with {asked}: not served under speculative decoding "
            "(the entropic controller is)"
        )
    if config.pruning_on and config.pruning.selector == "surprisal":
        raise ValueError(
            f"pruning.selector 'surprisal' with {asked}: its per-token scores are not recorded inside verification"
        )
    tp, pp = int(args.get("tp_size") or 1), int(args.get("pp_size") or 1)
    if pp > 1:
        raise ValueError(
            f"{spell('pp_size', pp)} with {asked}: not served (the plugin's verification runs on the "
            "last pipeline stage's logits only)"
        )
    draft = config.speculative.draft or ("acceptance" if tp > 1 else "entropy")
    if tp > 1 and draft == "entropy":
        raise ValueError(
            f"speculative.draft 'entropy' with {spell('tp_size', tp)}: its cost table is timed "
            "on each rank and the ranks must agree on every step's width; use 'acceptance', 'matched' "
            "or 'fixed'"
        )
    if config.pruning_on:  # KV pages of pruning.page_size tokens: SGLang verifies trees there with FlashInfer only
        breadth = args.get("speculative_ngram_max_bfs_breadth")
        if breadth is None:
            updates["speculative_ngram_max_bfs_breadth"] = 1
        elif int(breadth) != 1:
            raise ValueError(
                f"{spell('speculative_ngram_max_bfs_breadth', breadth)} with --entropic {config.mode}: "
                f"pruning pages the KV pool ({config.pruning.page_size} tokens a page), where SGLang "
                "verifies draft chains only; use breadth 1, or a mode without pruning"
            )
    if device == "cpu":
        backend = args.get("attention_backend")
        if backend is None:
            updates["attention_backend"] = ATTENTION_BACKEND
        elif backend not in CPU_VERIFY_BACKENDS:
            raise ValueError(
                f"{spell('attention_backend', backend)} with {asked}: it has no verify forward on CPU; "
                f"drop it (the launcher picks {ATTENTION_BACKEND!r}, which has one)"
            )
    spec = config.speculative.model_copy(update={"algorithm": "NGRAM", "draft": draft, "source": source})
    return config.model_copy(update={"speculative": spec}), updates


def default_blocker(config: EntropicConfig, args: Mapping[str, Any], spell: Spell) -> str | None:
    """Why `--entropic full` does not turn speculation on by itself, or None: what the user set that speculation
    would refuse (`speculative_args`) or that it was never run with here. Asking for it explicitly gives the
    refusal's full reason."""
    for name, (neutral, _) in REFUSED_WITH_SPECULATION.items():
        if name in args and args[name] != neutral:
            return spell(name, args[name])
    if config.sampling.controller == "mirostat_v2":
        return "sampling.controller 'mirostat_v2'"
    if config.pruning_on and config.pruning.selector == "surprisal":
        return "pruning.selector 'surprisal'"
    for name in ("pp_size", "dp_size"):  # dp: the NGRAM worker per DP rank was never run under the plugin
        if int(args.get(name) or 1) > 1:
            return spell(name, args[name])
    if args.get("enable_dp_attention"):
        return spell("enable_dp_attention", True)
    return None


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def spell_flag(name: str, value: Any) -> str:
    return flag(name) if isinstance(value, bool) else f"{flag(name)} {value}"


def spell_kwarg(name: str, value: Any) -> str:
    return f"{name}={value!r}"


SPECULATIVE_FIELDS = (
    "speculative_algorithm",
    "speculative_ngram_max_bfs_breadth",
    "attention_backend",
    "tp_size",
    "pp_size",
    "dp_size",
    "enable_dp_attention",
    *REFUSED_WITH_SPECULATION,
)
