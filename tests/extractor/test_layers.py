"""Layer-id conventions: defaults, validation, and resolving drafter ids against a model's own rule."""

from __future__ import annotations

import pytest

from extractor.layers import check_layer_ids, default_layer_ids, resolve_drafter_layer_ids


class RuleModel:
    """Stand-in for set_eagle3_layers_to_capture + read-back, with SGLang 0.5.23's two rules
    (llama.py L929 and deepseek_v2.py L3458); the live models are checked in test_parity/test_deepseek."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.calls: list[list[int]] = []

    def __call__(self, ids: list[int]) -> list[int]:
        self.calls.append(ids)
        if self.family == "llama" or ids[0] == 1:
            return [k + 1 for k in ids]
        return list(ids)


def test_default_ids_are_the_missions_for_61_layers():
    assert default_layer_ids(61) == [2, 30, 58]
    assert default_layer_ids(8) == [2, 4, 5]


@pytest.mark.parametrize(
    "family, canonical, drafter",
    [
        ("llama", [2, 30, 58], [2, 30, 58]),
        ("llama", [0, 1, 2], [0, 1, 2]),
        ("deepseek", [2, 30, 58], [3, 31, 59]),
        ("deepseek", [1, 2, 4], [1, 2, 4]),
        ("deepseek", [2, 3, 4], [3, 4, 5]),
    ],
)
def test_resolve_drafter_ids(family, canonical, drafter):
    got_drafter, captured = resolve_drafter_layer_ids(RuleModel(family), canonical)
    assert got_drafter == drafter
    assert captured == [k + 1 for k in canonical]


def test_unreachable_ids_are_rejected_with_what_was_tried():
    # deepseek_v2 cannot capture the output of layer 0 through a drafter config
    with pytest.raises(ValueError, match=r"tried \[0, 1, 2\] -> layers_to_capture \[0, 1, 2\]"):
        resolve_drafter_layer_ids(RuleModel("deepseek"), [0, 1, 2])


@pytest.mark.parametrize(
    "ids, message",
    [
        ([], "empty"),
        ([4, 2], "strictly increasing"),
        ([2, 2], "strictly increasing"),
        ([2, 7], r"\[7\] cannot be captured from a 8-layer model"),
        ([-1, 2], r"\[-1\] cannot be captured"),
    ],
)
def test_check_layer_ids_rejects(ids, message):
    with pytest.raises(ValueError, match=message):
        check_layer_ids(ids, 8)


def test_check_layer_ids_accepts_up_to_second_to_last():
    assert check_layer_ids([0, 3, 6], 8) == [0, 3, 6]


def test_follower_ranks_that_never_report_time_out_with_a_message():
    import multiprocessing as mp

    from extractor.tensor_parallel import wait_for_ranks

    status = mp.get_context("spawn").Queue()
    status.put((1, None))
    with pytest.raises(TimeoutError, match=r"ranks \[2, 3\] were not ready 0 s after start.*rerun"):
        wait_for_ranks(status, [1, 2, 3], timeout_s=0.2)
    status.put((2, "OSError: no such file"))
    with pytest.raises(RuntimeError, match="rank 2 failed to start: OSError: no such file"):
        wait_for_ranks(status, [2], timeout_s=5)
