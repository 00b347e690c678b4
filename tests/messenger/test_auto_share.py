"""The shared hand-off on auto: a link auto routed through shm shares the granted pages as shm
does; a link it routed through tcp has nothing to share, and says so (the prefill node then
copies, pdkv/disagg/kv_share.py)."""
from __future__ import annotations

import pytest

from pdkv._messenger import Messenger
from pdkv.transports import AutoOptions

from test_shm_share import PAGE, _buffer


@pytest.mark.parametrize("same_host", [True, False], ids=["shm-link", "tcp-link"])
def test_share_on_auto_follows_the_links_route(same_host):
    a, b = Messenger("auto", 21, AutoOptions()), Messenger("auto", 22, AutoOptions())
    try:
        mma, src = _buffer(0xAA)
        mmb, dst = _buffer(0)
        lkey, region = a.register(src), b.register(dst)
        ca, ia = a.prepare(22, same_host=same_host)
        cb, ib = b.prepare(21, same_host=same_host)
        a.complete(ca, ib)
        b.complete(cb, ia)
        rkey = b.grant_range(region, 21, 4 * PAGE, 4 * PAGE)
        if same_host:
            a.share_pages(ca, lkey, 0, rkey, 4 * PAGE, 4 * PAGE)
            src[:PAGE] = 7  # computed in place: in b at once
            assert (dst[4 * PAGE:5 * PAGE] == 7).all()
        else:
            with pytest.raises(Exception, match="went through tcp: nothing to share"):
                a.share_pages(ca, lkey, 0, rkey, 4 * PAGE, 4 * PAGE)
            assert (src[:PAGE] == 0xAA).all() and (dst == 0).all()  # nothing aliased
        a.unshare_pages(ca, lkey, 0, 4 * PAGE)  # shared or not: no error
        assert (src[:PAGE] == 0xAA).all()  # a's own pages again
    finally:
        a.close()
        b.close()
