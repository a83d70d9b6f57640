"""Per-request validation of the tensorrt_llm twin (trtpipe/serving/request_checks.py): each bad input is one
ValueError naming it; good inputs pass unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from trtpipe.serving.request_checks import check_sampling, check_token_ids, word_lists


def test_token_ids_in_the_vocabulary():
    check_token_ids(np.array([0, 1, 511], np.int32), 512)
    for bad, where in (([1, -1], 1), ([512], 0), ([3, 4, 1 << 30], 2)):
        with pytest.raises(
            ValueError, match=rf"input_ids\[{where}\] = {bad[where]} is outside the vocabulary \[0, 512\)"
        ):
            check_token_ids(np.array(bad, np.int64), 512)


@pytest.mark.parametrize(
    "temperature, top_k, top_p, seed, message",
    [
        (float("nan"), 0, 0.0, None, "temperature must be a finite number"),
        (float("inf"), 0, 0.0, None, "temperature must be a finite number"),
        (-1.0, 0, 0.0, None, "temperature must be a finite number >= 0"),
        (1.0, -3, 0.0, None, "runtime_top_k must be >= 0"),
        (1.0, 0, float("nan"), None, r"runtime_top_p must be in \[0, 1\]"),
        (1.0, 0, 1.5, None, r"runtime_top_p must be in \[0, 1\]"),
        (1.0, 0, 0.5, -1, r"seed must be in \[0, 2\^64\)"),
    ],
)
def test_sampling_settings(temperature, top_k, top_p, seed, message):
    with pytest.raises(ValueError, match=message):
        check_sampling(temperature, top_k, top_p, seed)


def test_good_sampling_settings_pass():
    check_sampling(0.0, 0, 0.0, None)
    check_sampling(1.0, 40, 0.9, (1 << 64) - 1)


def test_word_lists():
    arr = np.array([[[5, 6, 7, 0], [2, 3, -1, -1]]], np.int32)
    assert word_lists(arr, "stop_words_list", 512) == [[5, 6], [7]]
    assert word_lists(np.zeros((1, 2, 0), np.int32), "stop_words_list", 512) == []
    for arr, message in (
        ([[[5, 6], [3, -1]]], "offset 0 = 3 must be > 0 and <= 2"),
        ([[[5, 6, 7], [2, 1, -1]]], "offset 1 = 1 must be > 2"),
        ([[[5, 6], [0, 2]]], "offset 0 = 0 must be > 0"),
        ([[[5, 6], [-1, 2]]], "offset 0 is -1 but a later offset is not"),
        ([[[-3, 6], [1, 2]]], r"stop_words_list ids\[0\] = -3 is outside the vocabulary"),
        ([[[5, 1 << 30], [1, 2]]], r"ids\[1\] = 1073741824 is outside"),
        ([[[5, 6], [1, 2], [0, 0]]], r"must have shape \[1, 2, L\]"),
    ):
        with pytest.raises(ValueError, match=message):
            word_lists(np.array(arr, np.int32), "stop_words_list", 512)
