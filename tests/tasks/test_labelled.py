import numpy as np

from selfsup_model.specials import CLS_ID, PAD_ID, SEP_ID
from tasks.labelled import truncate_windows


def test_truncation_keeps_framing_and_leaves_short_rows_alone():
    rows = np.array([
        [CLS_ID, 10, 11, 12, 13, SEP_ID, PAD_ID, PAD_ID],  # longer than 4: cut, re-closed with [SEP]
        [CLS_ID, 10, SEP_ID, PAD_ID, PAD_ID, PAD_ID, PAD_ID, PAD_ID],  # fits: unchanged
    ], dtype=np.int32)
    out = truncate_windows(rows, 4)
    np.testing.assert_array_equal(out, [[CLS_ID, 10, 11, SEP_ID], [CLS_ID, 10, SEP_ID, PAD_ID]])
    assert truncate_windows(rows, None) is rows and truncate_windows(rows, 8) is rows
    assert rows[0, 3] == 12  # the input is not modified
