"""Demo: an @sgl.function program with entropic sampling against the server.

python programs/demo.py [--url http://127.0.0.1:30000]   (default: $SGLANG_ENTROPIC_URL)
"""

import argparse
import os
import statistics

import sglang as sgl
from sglang.lang.chat_template import get_chat_template

import sgl_entropic


@sgl.function
def explain(s, topic):
    s += sgl.system("You are a concise, helpful assistant.")
    s += sgl.user(f"In two sentences, explain {topic}.")
    # The temperature follows the entropy: T_{t+1} = clip(T_t exp(-eta (H_t - H*)), t_min, t_max).
    s += sgl.assistant(sgl_entropic.gen("answer", max_tokens=96, target_entropy=1.5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default=os.environ.get("SGLANG_ENTROPIC_URL", "http://127.0.0.1:30000"))
    args = parser.parse_args()

    backend = sgl.RuntimeEndpoint(args.url)
    backend.chat_template = get_chat_template("chatml")  # not auto-detected for a local model folder
    sgl.set_default_backend(backend)

    for topic in ["why the sky is blue", "what a hash table is"]:
        state = explain.run(topic=topic)
        meta = state.get_meta_info("answer")
        print(f"\n### {topic}\n{state['answer'].strip()}")
        print(
            f"[{meta['completion_tokens']} tokens | entropy mean {statistics.mean(meta['entropy']):.2f} nats"
            f" | temperature {min(meta['temperature']):.2f}..{max(meta['temperature']):.2f}"
            f" | entropic time {meta['entropic_time']:.2f} nats"
            f" | d tau/dC {meta['entropic_efficiency']:.3f} nats/GFLOP]"
        )


if __name__ == "__main__":
    main()
