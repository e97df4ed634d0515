"""Layer ids: our canonical convention and SGLang's.

Canonical id k means "output of decoder layer k (0-based)", i.e. HF
``output_hidden_states[k+1]``. SGLang captures the residual stream *before*
layer i, so capturing canonical k means ``model.layers_to_capture`` must hold
k+1. Which ids a drafter config must carry to get there differs per model
family and SGLang version (llama/qwen add +1; deepseek_v2 adds +1 only when the
first id is 1), so ``resolve_drafter_layer_ids`` asks the live model instead
of encoding those rules.
"""

from __future__ import annotations

from typing import Callable, Sequence

HF_PARITY_CHECKED = frozenset({"LlamaForCausalLM", "Qwen3ForCausalLM", "DeepseekV3ForCausalLM"})
"""The language models whose captured states the tests compare with HF's ``output_hidden_states[k+1]``
(tests/extractor/test_parity.py, test_deepseek.py, test_kimi.py: Kimi-K2.5's is a DeepseekV3ForCausalLM). Other
SGLang model files may capture something else at the same ids (Gemma-3's layers defer the residual add, so its
capture is a layer's output without the residual stream): still what SGLang's EAGLE-3 serving feeds the drafter,
but not the states another engine's drafter would get."""


def default_layer_ids(num_layers: int) -> list[int]:
    """Low/mid/high layers, [2, N//2, N-3]: [2, 30, 58] for a 61-layer model. A model too shallow for
    three distinct ids gets those of them that can be captured (0..N-2), once each, in order."""
    last_capturable = max(0, num_layers - 2)
    return sorted({min(max(k, 0), last_capturable) for k in (2, num_layers // 2, num_layers - 3)})


def check_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Reject ids SGLang cannot capture, before any work starts."""
    ids = list(layer_ids)
    if not ids:
        raise ValueError("extract.layers is empty: name at least one decoder layer to capture")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(
            f"extract.layers={ids} must be strictly increasing: SGLang concatenates captured "
            "layers in model order, so the stored order would not match the ids"
        )
    last_capturable = num_layers - 2
    bad = [k for k in ids if not 0 <= k <= last_capturable]
    if bad:
        raise ValueError(
            f"extract.layers={ids}: {bad} cannot be captured from a {num_layers}-layer model. "
            f"SGLang captures a layer's output as the next layer's input, so ids run from 0 to "
            f"{last_capturable}; the last layer's output is available as the final hidden state "
            "(extract.last_hidden_state=true), post final norm"
        )
    return ids


def llama_convention(drafter_ids: Sequence[int]) -> list[int]:
    """The layers_to_capture SGLang's Llama-family models make of drafter ids (each + 1); the synthetic
    states source, which has no model to ask, reports this convention."""
    return [k + 1 for k in drafter_ids]


def resolve_drafter_layer_ids(
    set_and_read_back: Callable[[list[int]], list[int]], layer_ids: Sequence[int]
) -> tuple[list[int], list[int]]:
    """Find the drafter-config ids that make the live model capture ``layer_ids``.

    ``set_and_read_back(ids)`` calls the model's ``set_eagle3_layers_to_capture(ids)``
    (what SGLang's server does with ``eagle_config.eagle_aux_hidden_state_layer_ids``)
    and returns the ``layers_to_capture`` it produced. Returns
    ``(drafter_ids, layers_to_capture)``; the model is left capturing them.
    """
    wanted = [k + 1 for k in layer_ids]
    tried: list[tuple[list[int], list[int]]] = []
    # Only two conventions exist among SGLang's model families: ids name layer
    # outputs (+1 inside) or ids name before-layer positions (no +1).
    for candidate in (list(layer_ids), wanted):
        captured = list(set_and_read_back(candidate))
        if captured == wanted:
            return candidate, captured
        tried.append((candidate, captured))
    attempts = "; ".join(f"{ids} -> layers_to_capture {got}" for ids, got in tried)
    raise ValueError(
        f"no drafter layer ids make this SGLang model capture the outputs of layers {list(layer_ids)} "
        f"(layers_to_capture {wanted}); tried {attempts}. A drafter served by this SGLang version "
        "could not read these layers either: choose other extract.layers (e.g. starting at 1 or >= 2)"
    )
