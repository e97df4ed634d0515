"""SGLang's model registry, narrowed to the checkpoint's classes before SGLang is imported (every rank's start
imports about 250 model modules otherwise). That the narrowed registry loads the model is what every job test
on the tiny models shows (tests/jobs, tests/extractor/test_deepseek.py, test_kimi.py)."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

from extractor.sglang_compat import DISABLED_MODEL_MODULES, register_only_models_naming


def model_sources() -> dict[str, str]:
    package = importlib.util.find_spec("sglang")
    directory = Path(package.submodule_search_locations[0]) / "srt" / "models"
    return {path.stem: path.read_text(errors="replace") for path in directory.glob("*.py")}


@pytest.fixture
def unset(monkeypatch):
    """The setting unset (empty) in this test, and as it was after it."""
    monkeypatch.setenv(DISABLED_MODEL_MODULES, "")


def test_only_the_modules_that_name_the_checkpoints_classes_are_imported(unset):
    sources = model_sources()
    skipped = register_only_models_naming(["LlamaForCausalLM", "LlamaForCausalLM"])
    assert os.environ[DISABLED_MODEL_MODULES] == ",".join(skipped)
    assert "llama" not in skipped  # where the class is defined
    kept = set(sources) - set(skipped) - {"__init__", "registry"}
    names = re.compile(r"\bLlamaForCausalLM\b")  # not LlamaForCausalLMEagle3, another class
    assert all(names.search(sources[name]) for name in kept)
    assert not any(names.search(sources[name]) for name in skipped)
    assert len(skipped) > len(kept) > 1, (len(skipped), kept)  # the modules that import it stay as well


def test_a_multimodal_checkpoint_keeps_its_language_models_modules_too(unset):
    skipped = register_only_models_naming(["KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM"])
    assert "deepseek_v2" not in skipped and "kimi_k25" not in skipped


def test_nothing_is_skipped_for_a_class_no_module_names_or_a_list_set_by_the_user(unset, monkeypatch):
    """SGLang's own "not supported" error then names the class; a list in the environment is the user's."""
    assert register_only_models_naming(["NoSuchModelForCausalLM"]) == []
    assert os.environ[DISABLED_MODEL_MODULES] == ""
    monkeypatch.setenv(DISABLED_MODEL_MODULES, "qwen3")
    assert register_only_models_naming(["LlamaForCausalLM"]) == []
    assert os.environ[DISABLED_MODEL_MODULES] == "qwen3"
