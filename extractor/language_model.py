"""The language model inside the class SGLang serves, found the way SGLang finds it.

SGLang serves multimodal checkpoints through wrapper classes:
``KimiK25ForConditionalGeneration`` holds a ``DeepseekV3ForCausalLM`` as
``language_model`` (with ``model`` as an alias property), Gemma-3/Llama-4
wrappers hold theirs as ``language_model``, Qwen-VL wrappers keep the decoder
as ``model``. Every one forwards ``set_eagle3_layers_to_capture``, which is all
SGLang's EAGLE-3 path calls on the target (``configure_aux_hidden_state_capture``
in model_runner_components/attention_backend_setup.py, 0.5.23; the model runner
in 0.5.17). To read back what that call did, this module walks to the decoder
stack with SGLang's own rule: ``model_loader.utils.resolve_language_model``
(``.model``, else ``.language_model``), then down ``.model`` until a module owns
``layers``, as the prefill graph runner does (``_resolve_transformer_layer_model``,
model_executor/runner/prefill_cuda_graph_runner.py, 0.5.23). The same path
serves 0.5.17 and 0.5.23.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional


class LanguageModel:
    """The served model, its language model and the decoder stack that captures the aux states."""

    def __init__(self, served: Any, text_config: Any) -> None:
        """``text_config``: SGLang's ``ModelConfig.hf_text_config``, the config it builds the language model from."""
        from sglang.srt.model_loader.utils import resolve_language_model

        self.served = served
        chain = [served]
        module = resolve_language_model(served)
        while True:
            if module is not chain[-1]:
                chain.append(module)
            if hasattr(module, "layers") or not hasattr(module, "model") or module.model is module:
                break
            module = module.model
        if not hasattr(module, "layers_to_capture"):
            raise RuntimeError(
                f"{type(served).__name__}: the decoder stack SGLang resolves ({type(module).__name__}) has no "
                "layers_to_capture, so SGLang cannot capture EAGLE-3 aux states from this model"
            )
        self.decoder = module
        # The module whose forward ends in the logits processor: the wrapper's language model,
        # or the served class itself for a bare causal LM or a wrapper that computes logits itself.
        self.causal_lm = next((m for m in reversed(chain) if hasattr(m, "logits_processor")), served)
        self._chain = chain
        # layers_to_capture indexes this stack (with pipeline parallelism it holds placeholders,
        # so its length is still the model's depth).
        self.num_layers = len(module.layers)
        self.hidden_size = int(text_config.hidden_size)

    @property
    def architecture(self) -> str:
        """The class SGLang serves (the checkpoint's ``architectures[0]``)."""
        return type(self.served).__name__

    @property
    def language_model_architecture(self) -> str:
        """The class inside it that computes the states: the same as ``architecture`` for a bare LM."""
        return type(self.causal_lm).__name__

    @property
    def logits_processor(self) -> Any:
        return self.causal_lm.logits_processor

    def set_and_read_back(self, drafter_ids: Optional[list[int]]) -> list[int]:
        """What SGLang's server does with a drafter config's ids (None: it found none); returns what
        the decoder captures."""
        self.served.set_eagle3_layers_to_capture(None if drafter_ids is None else list(drafter_ids))
        return list(self.decoder.layers_to_capture)

    @contextlib.contextmanager
    def capture_off(self) -> Iterator[None]:
        """Capture switched off on a loaded model, restored afterwards.

        Both the capture flag (on every module of the chain that has one) and the
        decoder's ``layers_to_capture`` must be cleared.
        """
        flagged = [m for m in self._chain if hasattr(m, "capture_aux_hidden_states")]
        saved = [m.capture_aux_hidden_states for m in flagged], list(self.decoder.layers_to_capture)
        try:
            for module in flagged:
                module.capture_aux_hidden_states = False
            self.decoder.layers_to_capture = []
            yield
        finally:
            for module, flag in zip(flagged, saved[0]):
                module.capture_aux_hidden_states = flag
            self.decoder.layers_to_capture = saved[1]
