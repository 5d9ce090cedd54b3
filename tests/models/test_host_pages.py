import mmap
from pathlib import Path

import pytest
import torch

from moecache.calibration import ExpertShape, make_pool
from moecache.errors import MoecacheError
from moecache.models.expert_store import ExpertStore
from moecache.models.host_pages import HUGE_PAGE, huge_page_bytes, huge_pages_of

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's THP mode (the bracketed word), or None where it cannot be read."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else None


needs_madvise = pytest.mark.skipif(
    thp_mode() != "madvise" or not hasattr(mmap, "MADV_HUGEPAGE"),
    reason="the kernel's THP mode is not madvise (huge pages either everywhere or nowhere)",
)


def test_a_huge_page_buffer_is_aligned_writable_and_its_size():
    buf = huge_page_bytes(3 * HUGE_PAGE + 5)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * HUGE_PAGE + 5
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert buf.data_ptr() % HUGE_PAGE == 0
    buf.fill_(7)
    assert int(buf.sum()) == 7 * buf.numel()


def test_a_bad_page_kind_is_refused():
    with pytest.raises(MoecacheError, match="host pages 'small'"):
        huge_page_bytes(HUGE_PAGE, "small")


@needs_madvise
def test_filled_store_and_calibration_pool_get_huge_pages_and_base_pages_do_not():
    """Under THP "madvise" the store's and the calibration pool's memory is in huge pages once written;
    `pages="base"` (torch.empty) is not."""
    store = ExpertStore.allocate(1, 4, 1024, 512, torch.bfloat16)  # 4 x 3 MiB
    store.flat_GB.fill_(1)
    assert huge_pages_of(store.flat_GB) >= 4 * HUGE_PAGE
    gate_up_P2IH, down_PHI = make_pool(ExpertShape(1024, 512), 4, torch.bfloat16)
    assert huge_pages_of(gate_up_P2IH) >= 2 * HUGE_PAGE and huge_pages_of(down_PHI) >= HUGE_PAGE
    base = ExpertStore.allocate(1, 4, 1024, 512, torch.bfloat16, pages="base")
    base.flat_GB.fill_(1)
    assert huge_pages_of(base.flat_GB) == 0
