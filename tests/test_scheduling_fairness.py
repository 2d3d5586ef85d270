"""No priority for sale: nothing a request sends, and nothing other requests over the same prompt
did, raises a request's place in the macro loop's order above what the server's config allows."""

from types import SimpleNamespace

import torch

from sgl_entropic.config import EntropicConfig
from sgl_entropic.costs import ModelDims
from sgl_entropic.plugin import admission, runtime
from sgl_entropic.plugin.scheduling import policy
from sgl_entropic.scheduling import Scales, order_waiting
from tests.stepping import Stepper

NO_CACHE = SimpleNamespace(tree_cache=SimpleNamespace(disable=True))


def _server(rt) -> None:
    """What admission learns from the scheduler at the first request, set by hand (no scheduler here)."""
    rt.dims = ModelDims(num_layers=2, num_q_heads=2, num_kv_heads=1, head_dim=4, dense_flops_per_token=1e9)
    rt.scales = Scales(kv_ref_pages=1000.0)


def _arrive(rid: str, prompt: list[int], entropic=None):
    """A request as SGLang's scheduler creates it, through the plugin's admission hook."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    custom = {"entropic": entropic} if entropic is not None else None
    sp = SamplingParams(max_new_tokens=64, temperature=1.0, custom_params=custom)
    req = SimpleNamespace(
        rid=rid,
        sampling_params=sp,
        origin_input_ids=list(prompt),
        output_ids=[],
        num_matched_prefix_tokens=0,
        priority=None,
    )
    return admission.after_create_generation_req(req, None)


def test_a_high_target_entropy_buys_no_place_in_the_queue():
    rt = runtime.install(EntropicConfig(mode="full", scheduling={"order": "entropic"}))
    _server(rt)
    plain = _arrive("plain", range(200))
    bidder = _arrive("bidder", range(200), entropic={"target_entropy": 20.0})
    assert bidder.entropic.controller is not None  # the request really runs the controller it asked for
    queue = [bidder, plain]
    policy.after_calc_priority(None, NO_CACHE, queue)
    assert [r.rid for r in queue] == ["plain", "bidder"]  # equal work: arrival order, the bid counts for nothing
    assert bidder.entropic.gain.expected_gain == plain.entropic.gain.expected_gain == rt.config.scheduling.max_gain


def _burst(stepper: Stepper, prompt: list[int], n: int) -> None:
    """n requests over one system prompt, decoded with the largest entropy drops there are: each step
    alternates a flat distribution (H = ln V) and a peaked one (H ~ 0)."""
    reqs = [stepper.req(prompt_ids=prompt + [i]) for i in range(n)]
    flat, peaked = torch.zeros(n, 50), torch.full((n, 50), -30.0)
    peaked[:, 3] = 0.0
    for step in range(12):
        stepper.step(reqs, (flat if step % 2 == 0 else peaked).clone(), [1.0] * n)
    assert all(r.entropic.gain.expected_gain > stepper.rt.config.scheduling.max_gain for r in reqs)


def _tenant_order(stepper: Stepper, system: list[int]) -> list[str]:
    """Order of new requests of two tenants: two over `system`, one over another prompt."""
    reqs = []
    for rid, prompt, n in (("a1", system, 300), ("b1", [9] * 40, 250), ("a2", system, 200)):
        state = stepper.rt.new_request_state(None, None)
        reqs.append(
            SimpleNamespace(
                rid=rid,
                entropic=state,
                origin_input_ids=(prompt + [1] * n)[:n],
                output_ids=[],
                num_matched_prefix_tokens=0,
                priority=None,
                sampling_params=SimpleNamespace(max_new_tokens=64, ignore_eos=False),
            )
        )
    views = policy.request_views(stepper.rt, reqs, running=False)
    return [reqs[i].rid for i in order_waiting(views, stepper.rt.config.scheduling, stepper.rt.scales)]


def test_a_burst_over_one_system_prompt_moves_no_other_tenants_order():
    system = [7] * 64
    quiet, busy = Stepper(EntropicConfig(mode="scheduling")), Stepper(EntropicConfig(mode="scheduling"))
    for stepper in (quiet, busy):
        _server(stepper.rt)
    _burst(busy, system, 40)
    busy.rt.served = quiet.rt.served  # the same age for the new requests: only the burst differs
    assert _tenant_order(busy, system) == _tenant_order(quiet, system) == ["a2", "b1", "a1"]
