/* FAKE transport for fault injection in tests of the layers above the transport.
 *
 * Endpoints live in one process; a write is a bounds-checked memcpy into the peer's registered
 * region, with the same checks and error reporting as tcp (key, grant, bounds). Faults apply to
 * the writes this endpoint posts, numbered from 0 in post order:
 *   DROP       the write never lands (no IMM at the peer) but completes locally
 *   DELAY      it lands delay_us later (delivered on a later poll)
 *   DUPLICATE  it lands twice (the peer counts the immediate twice)
 *   CORRUPT    the peer sees a corrupted header: ERROR on both sides, connection dropped
 *   ERROR      it lands but completes locally with ERROR (-EIO)
 *   VANISH     the peer disappears at this write: this and every later write fail, the peer
 *              sees the connection drop
 */
#ifndef PDKV_FAKE_H
#define PDKV_FAKE_H

#include "transport.h"

enum pdkv_fake_fault_kind {
    PDKV_FAKE_DROP = 1,
    PDKV_FAKE_DELAY = 2,
    PDKV_FAKE_DUPLICATE = 3,
    PDKV_FAKE_CORRUPT = 4,
    PDKV_FAKE_ERROR = 5,
    PDKV_FAKE_VANISH = 6,
};

pdkv_transport *pdkv_fake_create(uint64_t node_id, char *err, size_t errlen);
/* Apply `kind` to writes [first, first+count) posted by t (count 0: every later write). */
int pdkv_fake_add_fault(pdkv_transport *t, int kind, uint64_t first, uint64_t count, uint32_t delay_us);

#endif
