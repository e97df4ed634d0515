"""What the two EAGLE-3 trainers read, built from a ``Sample``: their files and their dataset items.

Matched against their public code (read 2026-12), cited in each function below: SpecForge
(sgl-project/SpecForge; one ``torch.save`` dict per sample under ``rows_*/``) and speculators
(vllm-project/speculators; a preprocessed HF dataset and one ``hs_{i}.safetensors`` per row). The
layouts as a user sees them: docs/training.md.
"""

from __future__ import annotations

import torch

from storage.reader import Sample
from training.final_state import FORMATS, SPECFORGE, SPECULATORS  # noqa: F401 - the trainers, named here too

SPECFORGE_GROUP_SIZE = 2000
"""Files per ``rows_*`` folder: SpecForge's ``--file-group-size`` default."""
SPECFORGE_MAX_LEN = 2048
"""SpecForge's ``--max-length`` default."""
SPECULATORS_HIDDEN_STATES_DIR = "hidden_states"
SPECULATORS_TOKEN_FREQ_FILE = "token_freq.pt"
FP8_MAX = 448.0
"""Largest float8_e4m3fn value."""
SPECULATORS_MIN_SCALE = 1e-12
"""speculators clamps its fp8 scales to at least this (a token of zeros)."""
QUANTIZE_CHUNK_TOKENS = 256
"""Tokens quantized at once: bounds the float32 temporaries of a long sample."""


# -- SpecForge ------------------------------------------------------------------------------------

def specforge_path(sample_id: int, group_size: int = SPECFORGE_GROUP_SIZE) -> str:
    """Where SpecForge keeps sample ``sample_id``: ``rows_{g}-{g+2000}/data_{sample_id}.ckpt``.

    ``scripts/prepare_hidden_states.py`` ``HiddenStatesGenerator._get_file_path``:
    ``rows_{g}-{g + file_group_size}/data_{idx}.ckpt``, ``g = idx // file_group_size * file_group_size``,
    ``idx`` the sample's global index in its dataset.
    """
    group = sample_id // group_size * group_size
    return f"rows_{group}-{group + group_size}/data_{sample_id}.ckpt"


def specforge_file(sample: Sample) -> dict[str, torch.Tensor]:
    """The dict SpecForge's generator ``torch.save``s for a sample (``asdict(DataPoint)``, in its key order).

    ``scripts/prepare_hidden_states.py`` ``DataPoint``: ``input_ids`` [T] int64, ``loss_mask`` [T] int64,
    ``hidden_state`` [1, T, H] (the target's final state after its final norm: the trainer applies only
    ``lm_head``), ``aux_hidden_state`` [1, T, L*H] (the captured layers concatenated in layer order); model
    dtype, nothing shifted.
    """
    return {
        "input_ids": sample.input_ids.to(torch.int64),
        "loss_mask": sample.loss_mask.to(torch.int64),
        "hidden_state": _final_state(sample).unsqueeze(0),
        "aux_hidden_state": sample.aux_hidden_states.unsqueeze(0),
    }


def specforge_item(sample: Sample, max_len: int = SPECFORGE_MAX_LEN) -> dict[str, torch.Tensor]:
    """What SpecForge's ``OfflineEagle3Dataset`` returns for this sample's file.

    ``specforge/data/preprocessing.py`` ``list_local_files`` (``*.ckpt`` / ``*.ckpt.gz`` under the
    directory, sorted by path) and ``OfflineEagle3Dataset`` (``torch.load(path, weights_only=False,
    mmap=True)``; ``process_data``), the same as ``specforge/algorithms/eagle3/data.py``
    ``normalize_offline_sample``: ``aux_hidden_state`` and ``hidden_state`` squeezed and cut to
    ``max_len``, ``input_ids`` and ``loss_mask`` cut to ``max_len``, every tensor given a leading batch
    dimension of 1, the last ``loss_mask`` entry set to 0, ``attention_mask`` ones (int64). SpecForge
    0.2.0's trainer lists the files with ``specforge/runtime/data_plane/offline_reader.py``
    ``list_feature_files`` (absolute paths, sorted as strings: the order ``training.dataset``'s SpecForge
    view keeps) and loads each with ``feature_store.load_feature_file``; the tests run those two and
    ``normalize_offline_sample``.
    """
    loss_mask = sample.loss_mask[:max_len].to(torch.int64).unsqueeze(0)  # a new tensor: the mask is changed
    loss_mask[0, -1] = 0
    return {
        "attention_mask": torch.ones_like(loss_mask, dtype=torch.long),
        "loss_mask": loss_mask,
        "target": _final_state(sample)[:max_len].unsqueeze(0),
        "hidden_state": sample.aux_hidden_states[:max_len].unsqueeze(0),
        "input_ids": sample.input_ids[:max_len].to(torch.int64).unsqueeze(0),
    }


# -- speculators ----------------------------------------------------------------------------------

def speculators_path(row: int) -> str:
    """Where speculators keeps the states of dataset row ``row``: ``scripts/data_generation_offline.py``
    writes ``<preprocessed>/hidden_states/hs_{i}.safetensors`` for row ``i`` of the preprocessed dataset."""
    return f"{SPECULATORS_HIDDEN_STATES_DIR}/hs_{row}.safetensors"


def speculators_file(sample: Sample, hidden_size: int, fp8: bool) -> dict[str, torch.Tensor]:
    """The tensors of ``hs_{i}.safetensors``: ``hidden_states`` [T, L+1, H] (+ ``hidden_states_scales``
    [T, 1, 1] float32 when ``fp8``) and ``token_ids`` [T] int64.

    ``hidden_states`` holds the captured layers, then the verifier's final state before its final norm;
    the fp8 variant (``speculators/data_generation/fp8_hidden_states_connector.py``, ``fp8_utils.py``)
    stores it as float8_e4m3fn with one float32 scale per token over all its layers.

    ``sample`` holds model-dtype states, or raw fp8 states with their per-layer scales (a reader with
    ``raw_fp8=True``); fp8 output is quantized as speculators does, from float32 values: the model-dtype
    states, or the raw fp8 values times their scales, ``QUANTIZE_CHUNK_TOKENS`` tokens at a time.
    """
    tokens = sample.input_ids.shape[0]
    parts = [
        (sample.aux_hidden_states.view(tokens, -1, hidden_size), sample.aux_hidden_states_scales),
        (_final_state(sample).view(tokens, 1, hidden_size), sample.last_hidden_state_scales),
    ]
    raw = sample.aux_hidden_states_scales is not None
    tensors: dict[str, torch.Tensor] = {}
    if fp8:
        groups = sum(values.shape[1] for values, _ in parts)
        quantized = torch.empty((tokens, groups, hidden_size), dtype=torch.float8_e4m3fn)
        scales = torch.empty((tokens, 1, 1), dtype=torch.float32)
        for start in range(0, tokens, QUANTIZE_CHUNK_TOKENS):
            chunk = slice(start, start + QUANTIZE_CHUNK_TOKENS)
            values = torch.cat([_float32(v[chunk], s[chunk] if s is not None else None) for v, s in parts], dim=1)
            quantized[chunk], scales[chunk] = quantize_per_token(values)
        tensors["hidden_states"], tensors["hidden_states_scales"] = quantized, scales
    elif raw:
        raise ValueError("model-dtype speculators files come from model-dtype states: read the shard without raw_fp8")
    else:
        tensors["hidden_states"] = torch.cat([values for values, _ in parts], dim=1)
    tensors["token_ids"] = sample.input_ids.to(torch.int64).contiguous()
    return tensors


def _float32(values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """[t, G, H] states as float32: model-dtype values, or fp8 values times their [t, G] scales."""
    return values.float() if scales is None else values.float() * scales.unsqueeze(-1)


def quantize_per_token(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, G, H] -> float8_e4m3fn [T, G, H] and float32 scales [T, 1, 1]: one scale per token over all
    G slices, ``max(amax / 448, 1e-12)``, values ``(x.float() / scale)`` rounded to fp8 (speculators'
    ``quantize_tensor_to_fp8``)."""
    values = states.float()
    scales = (values.abs().amax(dim=(1, 2), keepdim=True) / FP8_MAX).clamp(min=SPECULATORS_MIN_SCALE)
    return (values / scales).to(torch.float8_e4m3fn), scales


def speculators_item(sample: Sample, hidden_size: int,
                     hidden_states_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """What speculators' ``ArrowDataset`` returns for this sample's row and ``hs_{i}`` file.

    ``speculators/train/data.py`` ``ArrowDataset._get_raw_data`` (``FileTransfer`` loads ``hs_{i}.safetensors``
    with ``safetensors.torch.load_file``) and ``BaseDataset.__getitem__``: ``hidden_states`` =
    ``hidden_states[:, :-1].flatten(1)`` [T, L*H], ``input_ids`` = ``token_ids``,
    ``verifier_last_hidden_states`` = ``hidden_states[:, -1]`` [T, H], ``loss_mask`` = the dataset row's
    (int64), the ``*hidden_states*`` keys cast to ``hidden_states_dtype`` (bf16), then ``lengths`` = [T]
    and ``position_ids`` = arange(T), int64.
    """
    tokens = sample.input_ids.shape[0]
    return {
        "hidden_states": sample.aux_hidden_states.to(hidden_states_dtype),
        "input_ids": sample.input_ids.to(torch.int64),
        "verifier_last_hidden_states": _final_state(sample).view(tokens, hidden_size).to(hidden_states_dtype),
        "loss_mask": sample.loss_mask.to(torch.int64),
        "lengths": torch.tensor([tokens], dtype=torch.long),
        "position_ids": torch.arange(tokens, dtype=torch.long),
    }


def _final_state(sample: Sample) -> torch.Tensor:
    if sample.last_hidden_state is None:
        raise ValueError(f"sample {sample.sample_id} has no final hidden state")
    return sample.last_hidden_state
