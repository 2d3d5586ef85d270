"""H_t per decode step of a few real requests, the entropic controller against a fixed temperature.

Starts one server (`--entropic sampling`, bundled model), sends each prompt twice with
`return_entropy`: once with the controller (`custom_params.entropic.target_entropy` = H*), once at
a fixed temperature (no controller object: SGLang's own sampling). Writes the traces
(entropy, temperature per output token) to docs/data/entropy_traces.json for benchmarks/figures.py.
"""

from __future__ import annotations

import argparse
import json

import common

PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "List five ideas for a weekend trip and say why each is worth it.",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target-entropy", type=float, default=2.0, help="H* of the controller (nats)")
    ap.add_argument("--temperature", type=float, default=1.0, help="the fixed temperature, and the controller's t_init")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=str(common.ROOT / "docs" / "data" / "entropy_traces.json"))
    args = ap.parse_args()

    device, model = common.default_device(), common.bundled_model()
    port = common.free_port()
    cmd = common.ours_command(port, common.sglang_common_args(model, device, args.dtype), "sampling")
    traces = []
    with common.start_server("traces", cmd, port, common.server_env(device, stock=False)) as srv:
        for i, prompt in enumerate(PROMPTS):
            for controlled in (True, False):
                params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "ignore_eos": True}
                if controlled:
                    params["custom_params"] = {"entropic": {"target_entropy": args.target_entropy}}
                res = common.generate(
                    srv.url, {"text": common.chat(prompt), "return_entropy": True, "sampling_params": params}
                )
                if not res.ok:
                    raise RuntimeError(f"prompt {i}: {res.error}")
                traces.append(
                    {
                        "prompt": prompt,
                        "controller": controlled,
                        "entropy": res.meta["entropy"],
                        "temperature": res.meta["temperature"],
                        "entropic_time": res.meta["entropic_time"],
                    }
                )
                common.log_line(
                    f"prompt {i} {'controller' if controlled else 'fixed T'}: {len(res.meta['entropy'])} tokens"
                )
    data = {
        "target_entropy": args.target_entropy,
        "fixed_temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
        "environment": common.environment(),
        "traces": traces,
    }
    with open(args.out, "w") as f:
        json.dump(common._clean(data), f, indent=1)
    common.log_line(f"wrote {args.out}")


if __name__ == "__main__":
    main()
