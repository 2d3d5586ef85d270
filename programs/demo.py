"""Demo: an @sgl.function program against the entropic server.

    python programs/demo.py [--url http://127.0.0.1:30000]   (default: $SGLANG_ENTROPIC_URL)
"""

import argparse
import os

import sglang as sgl
from sglang.lang.chat_template import get_chat_template


@sgl.function
def explain(s, topic):
    s += sgl.system("You are a concise, helpful assistant.")
    s += sgl.user(f"In two sentences, explain {topic}.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=96, temperature=0.8))


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
        print(f"[{meta['completion_tokens']} tokens, finish: {meta['finish_reason']['type']}]")


if __name__ == "__main__":
    main()
