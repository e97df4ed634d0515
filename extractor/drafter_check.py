"""Which layers the installed SGLang would capture from a target for a given EAGLE-3 drafter config.

Nothing is loaded: the target and each drafter are built as SGLang builds them
for serving, on the meta device (``sglang_compat.MetaModels``), so a
1T-parameter target costs about a second on a CPU box. For every drafter config
this does what SGLang's EAGLE-3 server does at start-up: parse the drafter's
config.json with SGLang's ``ModelConfig(is_draft_model=True)``, build the
drafter class, read its ``eagle_config`` (``drafter_config.sglang_reads``) and
call the target's ``set_eagle3_layers_to_capture`` with those ids
(``configure_aux_hidden_state_capture``), then read ``layers_to_capture`` back.
``plan_capture`` does what the job's engine does at start-up (the drafter ids
that make SGLang capture the wanted layers) and checks the drafter config the
job would write with them, for the dry run (``jobs.planning.dry_run``).

Starts SGLang's runtime: one call per process.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any, Optional

from extractor.checkpoint import read_config, text_config
from extractor.drafter_config import build_drafter_config, sglang_reads
from extractor.layers import check_layer_ids, resolve_drafter_layer_ids


@dataclasses.dataclass(frozen=True)
class TargetModel:
    sglang_version: str
    architecture: str
    language_model_architecture: str
    num_layers: int
    hidden_size: int
    default_layers_to_capture: list[int]
    """What SGLang captures when a drafter config names no ids."""


@dataclasses.dataclass(frozen=True)
class DrafterCapture:
    """What SGLang makes of one drafter config on the target."""

    drafter_architecture: str
    use_aux_hidden_state: bool
    drafter_layer_ids: Optional[list[int]]
    """The ids SGLang read from the config; None: it found none and used its default."""
    layers_to_capture: list[int]
    """The target's ``layers_to_capture`` afterwards ([] when aux capture is off)."""
    error: Optional[str] = None
    """Why SGLang could not parse or build the drafter, if it could not."""


@dataclasses.dataclass(frozen=True)
class CapturePlan:
    """What the job's extractor will report for its layer ids, found without loading a weight."""

    target: TargetModel
    layer_ids: list[int]
    layers_to_capture: list[int]
    drafter_layer_ids: list[int]
    served_drafter: DrafterCapture
    """SGLang serving the drafter config the job writes with ``drafter_layer_ids``: it must capture
    ``layers_to_capture`` again."""


def capture_with_drafters(
    target_path: str, drafter_configs: list[dict[str, Any]]
) -> tuple[TargetModel, list[DrafterCapture]]:
    """Ask SGLang what each drafter config would make it capture from the target at ``target_path``."""
    models, target, info = _meta_target(target_path)
    return info, [_capture_with(models, target, config) for config in drafter_configs]


def plan_capture(target_path: str, layer_ids: list[int], dtype: str) -> CapturePlan:
    """The layers_to_capture and drafter ids the job's engine will find for ``layer_ids`` (the same
    ``resolve_drafter_layer_ids`` on the same model class, built on the meta device), and what SGLang
    captures when it serves the drafter config the job writes with those ids."""
    models, target, info = _meta_target(target_path)
    ids = check_layer_ids(layer_ids, target.num_layers)
    drafter_ids, captured = resolve_drafter_layer_ids(target.set_and_read_back, ids)
    drafter_config = build_drafter_config(text_config(read_config(target_path)), drafter_ids, dtype)
    return CapturePlan(info, ids, captured, drafter_ids, _capture_with(models, target, drafter_config))


def _meta_target(target_path: str) -> tuple[Any, Any, TargetModel]:
    from extractor.cpu_shims import install_cpu_shims

    install_cpu_shims()  # before the first sglang import; a real sgl-kernel is never shadowed
    from extractor.language_model import LanguageModel
    from extractor.sglang_compat import MetaModels, import_sglang

    sgl = import_sglang()
    models = MetaModels(sgl, target_path)
    target = LanguageModel(models.target, models.target_config.hf_text_config)
    info = TargetModel(
        sglang_version=sgl.version, architecture=target.architecture,
        language_model_architecture=target.language_model_architecture, num_layers=target.num_layers,
        hidden_size=target.hidden_size, default_layers_to_capture=target.set_and_read_back(None),
    )
    return models, target, info


def _capture_with(models: Any, target: Any, drafter_config: dict[str, Any]) -> DrafterCapture:
    with tempfile.TemporaryDirectory(prefix="eagle3-drafter-") as directory:
        (Path(directory) / "config.json").write_text(json.dumps(drafter_config))
        try:
            draft_config = models.draft_config(directory)
            architecture = type(models.build_drafter(draft_config)).__name__
        except Exception as error:  # SGLang's own complaint is the finding
            return DrafterCapture("", False, None, [], error=f"{type(error).__name__}: {error}")
    use_aux, ids = sglang_reads(getattr(draft_config.hf_config, "eagle_config", None))
    captured = target.set_and_read_back(ids) if use_aux else []
    return DrafterCapture(architecture, use_aux, ids, captured)
