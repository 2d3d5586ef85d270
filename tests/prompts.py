"""Prompts over text nobody here wrote, shared by the speculative decoding tests."""

import inspect

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def real_prompts() -> list[str]:
    """Prompts over text nobody here wrote (SGLang's own sources and docs): copying work and an open question."""
    import sglang
    from sglang.srt.speculative import ngram_worker

    readme = open(sglang.__file__.replace("__init__.py", "README.md")).read()
    folders = readme.split("## Files")[0]
    code = inspect.getsource(ngram_worker.NGRAMWorker._efficient_concat_last_n)
    return [
        CHAT.format(f"{folders}\nList the folder names above, one per line."),
        CHAT.format(f"```python\n{code}```\nRewrite this function with type hints on every line."),
        CHAT.format("What is speculative decoding? Answer in two sentences."),
    ]
