"""The HTTP side (main process: HTTP server, tokenizer manager, sgl.Engine): requests checked at the edge, the
traces returned in `meta_info` and in the OpenAI endpoints' `sglext`; `frontend.py` serves SGLang's frontend
language in a client process."""

from __future__ import annotations

from sgl_entropic.config import EntropicConfig
from sgl_entropic.plugin.hooks import Hook


def hooks(config: EntropicConfig) -> list[Hook]:
    from sgl_entropic.plugin.serving import meta_info, openai_ext, validation

    S, T = "sglang.srt.", "sglang.srt.managers.tokenizer_manager.TokenizerManager."
    # fmt: off
    return [
        Hook(S + "sampling.sampling_params.SamplingParams.verify", "after", validation.after_verify, "main"),
        Hook(T + "_validate_one_request", "before", validation.before_validate_one_request, "main"),
        Hook(T + "_create_tokenized_object", "after", meta_info.after_create_tokenized_object, "main"),
        Hook(S + "entrypoints.http_server.ORJSONRequest.json", "around", validation.around_request_json, "main"),
        Hook(S + "managers.io_struct.GenerateReqInput.normalize_batch_and_arguments", "around",
             validation.around_normalize_batch_and_arguments, "main"),
        Hook(T + "update_request_meta_info", "after", meta_info.after_update_request_meta_info, "main"),
        Hook(S + "entrypoints.engine.Engine.generate", "around", meta_info.around_engine_generate, "main"),
        Hook(T + "generate_request", "before", meta_info.before_generate_request, "main"),
        # the OpenAI endpoints: sglext.entropic when asked
        *(Hook(S + f"entrypoints.openai.{module}.{cls}.{fn}", kind, handler, "main")
          for module, cls, build, stream in (
              ("serving_chat", "OpenAIServingChat", "_build_chat_response", "_generate_chat_stream"),
              ("serving_completions", "OpenAIServingCompletion", "_build_completion_response",
               "_generate_completion_stream"))
          for fn, kind, handler in (("_convert_to_internal_request", "after", openai_ext.after_convert_request),
                                    (build, "after", openai_ext.after_build_response),
                                    (stream, "around", openai_ext.around_stream))),
    ]
    # fmt: on
