"""The curated mutants `make mutants` applies (tools/mutants.py): realistic one-line bugs, per
area, each with the test files that must fail on it. Add the kinds of bug a new feature invites
when you add the feature; a mutant that cannot change behaviour (an equivalent rewrite) does not
belong here: say why in the commit and drop it.

Each edit replaces text that occurs exactly once in the file (the runner refuses otherwise), so a
refactor that moves the code makes the runner say which mutant to update instead of silently
testing nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str
    edits: tuple[tuple[str, str, str], ...]  # (file, text, replacement)
    tests: tuple[str, ...]  # test files (or file::test ids, to keep a run short); one must fail
    why: str  # the bug it stands for
    rebuild: bool = False  # C: rebuild the extensions in the scratch copy


def _m(name, area, path, old, new, tests, why, rebuild=False) -> Mutant:
    return Mutant(name, area, ((path, old, new),), tuple(tests), why, rebuild)


PREFIX_PROPS = "tests/engine/test_prefix_properties.py"
PREFIX = "tests/engine/test_prefix_cache.py"
PREFIX_SALT = PREFIX + "::test_the_hash_salt_changes_with_the_model_and_the_dtype"
CHOICE = "tests/disagg/test_choice.py"
GRAPHS = "tests/engine/test_cuda_graphs.py"
SPEC_SAMPLING = "tests/engine/test_spec_sampling.py"
SPEC_DRAFT_COUNTS = "tests/engine/test_spec_draft.py::test_self_draft_counts_every_position_exactly"
SPEC_METRICS_NGRAM = "tests/server/test_spec_metrics.py::test_stream_and_metrics_with_ngram"
SPEC_HOSTILE = ("tests/security/test_hostile_spec_prefill.py"
                "::test_malformed_spec_pages_and_next_token_are_answered_with_fail")
ROUTER_LOAD = "tests/router/test_router_load.py"
ROUTER_UNITS = "tests/router/test_router_units.py"
GRANTS = "tests/messenger/test_grants.py"
HOSTILE_TCP = ("tests/security/test_hostile_verbs_peer.py"
               "::test_writes_outside_granted_ranges_get_remote_access_errors[tcp]")
MOE_ROUTING = "tests/models/test_moe_routing.py"
MULTINIC = "tests/messenger/test_multinic.py::test_pick_nic_spreads_a_ranks_requests_over_its_nics"
AB_METRICS = "tests/bench/ab/test_metrics.py"
AB_VERDICT = "tests/bench/ab/test_verdict.py"

MUTANTS: list[Mutant] = [
    # ---- prefix cache (from the former tests/engine/prefix_mutants.py) ------------------------
    _m("publish_partial_page", "prefix", "pdkv/engine/prefix_reuse.py",
       "full = min(min(req.num_computed_tokens, req.num_tokens) // self.page_size, len(req.pages))",
       "full = min(-(-min(req.num_computed_tokens, req.num_tokens) // self.page_size), len(req.pages))",
       [PREFIX_PROPS], "a partly filled last page is published"),
    Mutant("publish_remote_early", "prefix", (
        ("pdkv/kv/allocator.py",
         "        if self._pinned[page]:\n            raise PageStateError(f\"page {page} is pinned",
         "        if False:\n            raise PageStateError(f\"page {page} is pinned"),
        ("pdkv/engine/scheduler.py", "        self.remote[req.request_id] = req\n        return True",
         "        self.remote[req.request_id] = req\n        req.num_computed_tokens += num_tokens\n"
         "        self.publish(req)\n        req.num_computed_tokens -= num_tokens\n        return True")),
        (PREFIX_PROPS,), "remote pages published before their writes landed"),
    _m("revive_stays_evictable", "prefix", "pdkv/kv/allocator.py",
       "            if self._refs[p] == 0:\n                del self._evictable[p]\n", "",
       [PREFIX_PROPS], "a cached page taken again stays in the LRU pool (evicted while in use)"),
    _m("evict_before_free", "prefix", "pdkv/kv/allocator.py",
       "            if self._free:\n                p = self._free.pop()",
       "            if self._free and not self._evictable:\n                p = self._free.pop()",
       [PREFIX_PROPS], "cached pages evicted while plain free pages are left"),
    _m("cached_page_leaks", "prefix", "pdkv/kv/allocator.py",
       "                if self._cached[p]:\n                    self._evictable[p] = None",
       "                if self._cached[p]:\n                    pass",
       [PREFIX_PROPS], "a released cached page never returns to the pool"),
    _m("hash_not_chained", "prefix", "pdkv/kv/prefix_cache.py",
       "        h = hashlib.blake2b(parent, digest_size=16)", "        h = hashlib.blake2b(salt, digest_size=16)",
       [PREFIX, PREFIX_PROPS], "a page's hash ignores the pages before it"),
    Mutant("reuse_last_token_page", "prefix", ((
        "pdkv/engine/prefix_reuse.py",
        "        pages = self.cache.acquire(self._hashes(req, req.num_tokens - 1))\n        req.pages = pages\n"
        "        req.num_computed_tokens = req.num_cached_tokens = len(pages) * self.page_size",
        "        pages = self.cache.acquire(self._hashes(req, req.num_tokens))\n        req.pages = pages\n"
        "        req.num_computed_tokens = req.num_cached_tokens = min(len(pages) * self.page_size, "
        "req.num_tokens - 1)"),), (PREFIX_PROPS,), "the page holding the last token is shared (then written)"),
    _m("unreuse_leaks_pages", "prefix", "pdkv/engine/prefix_reuse.py",
       "        self.allocator.free(req.pages)  # back to the LRU pool, contents kept", "        pass",
       [PREFIX_PROPS], "pages of an undone reuse are never given back"),
    _m("reuse_whole_sequence", "prefix", "pdkv/engine/prefix_reuse.py",
       "        pages = self.cache.acquire(self._hashes(req, req.num_tokens - 1))",
       "        pages = self.cache.acquire(self._hashes(req, req.num_tokens))",
       [PREFIX_PROPS], "a prompt of whole pages reuses its last page too"),
    _m("hash_skips_a_pages_last_token", "prefix", "pdkv/kv/prefix_cache.py",
       "token_ids[k * page_size:(k + 1) * page_size]", "token_ids[k * page_size:(k + 1) * page_size - 1]",
       [PREFIX + "::test_prompts_differing_only_in_a_pages_last_token_never_share_that_page"],
       "a page's hash leaves out its last token"),
    _m("salt_without_the_model", "prefix", "pdkv/kv/prefix_cache.py",
       '{"model": model_fingerprint, "dtype": dtype, "page_size": page_size}',
       '{"dtype": dtype, "page_size": page_size}',
       [PREFIX_SALT], "pages of different models hash alike"),
    _m("salt_without_the_dtype", "prefix", "pdkv/kv/prefix_cache.py",
       '{"model": model_fingerprint, "dtype": dtype, "page_size": page_size}',
       '{"model": model_fingerprint, "page_size": page_size}',
       [PREFIX_SALT], "float32 and bfloat16 KV of one model hash alike"),
    _m("fingerprint_without_the_config", "prefix", "pdkv/engine/factory.py",
       "h = hashlib.blake2b(json.dumps(loaded.hf_config, sort_keys=True, default=str).encode(), digest_size=16)",
       "h = hashlib.blake2b(digest_size=16)",
       [PREFIX_SALT], "the model's fingerprint is only its weight files' names and sizes"),
    # ---- CUDA-graph decode (the CPU stand-in runs the same DecodeGraphs) -----------------------
    _m("graph_output_is_a_view", "graphs", "pdkv/engine/cuda_graphs.py",
       "        return out[:n].clone()", "        return out[:n]",
       [GRAPHS], "a step returns a view of the static output: the next replay overwrites it"),
    _m("graph_padding_into_a_real_page", "graphs", "pdkv/engine/cuda_graphs.py",
       "list(batch.page_ids) + [[self.scratch]] * pad", "list(batch.page_ids) + [batch.page_ids[0]] * pad",
       [GRAPHS + "::test_padding_rows_write_only_the_scratch_page"],
       "padding rows write their K/V into the first request's page instead of the scratch page"),
    _m("graph_hook_not_told_of_the_replay", "graphs", "pdkv/engine/cuda_graphs.py",
       "            hook.replayed(self.num_layers)\n", "            pass\n",
       [GRAPHS + "::test_counter_bumps_once_per_layer_per_replay"],
       "a replay's layer bumps never reach the hook's host bookkeeping"),
    # ---- the prefill chooser ---------------------------------------------------------------------
    _m("affinity_ignores_failure_and_room", "chooser", "pdkv/disagg/choice.py",
       "rank(held)[:3] == rank(best)[:3]", "rank(held)[:1] == rank(best)[:1]",
       [CHOICE], "the affinity holder wins though it just failed or has no room"),
    _m("room_in_pages_not_tokens", "chooser", "pdkv/disagg/choice.py",
       "route.report.free_pages * self.page_size < n", "route.report.free_pages < n",
       [CHOICE], "room judged by comparing pages with tokens"),
    _m("affinity_bound_exclusive", "chooser", "pdkv/disagg/choice.py",
       "q[held] <= q[best] + self.cfg.affinity_max_extra_tokens",
       "q[held] < q[best] + self.cfg.affinity_max_extra_tokens",
       [CHOICE], "the affinity bound excludes its own value"),
    # ---- the A/B harness: client numbers and the seed's verdict ---------------------------------
    _m("tpot_divides_by_all_tokens", "ab", "pdkv/bench/ab/metrics.py",
       "return (r.e2e_s - r.ttft_s) / (r.num_tokens - 1)", "return (r.e2e_s - r.ttft_s) / r.num_tokens",
       [AB_METRICS], "TPOT divided by every token, the first one included"),
    _m("tpot_slo_against_ttft", "ab", "pdkv/bench/ab/metrics.py",
       "(t is None or t <= slo.tpot_s)", "(t is None or t <= slo.ttft_s)",
       [AB_METRICS], "goodput checks TPOT against the TTFT objective"),
    _m("percentile_off_by_one", "ab", "pdkv/bench/ab/metrics.py",
       "k = (len(s) - 1) * q / 100.0", "k = len(s) * q / 100.0",
       [AB_METRICS], "percentile rank computed over n instead of n - 1"),
    _m("percentile_no_interpolation", "ab", "pdkv/bench/ab/metrics.py",
       "return s[lo] + (s[hi] - s[lo]) * (k - lo)", "return s[lo]",
       [AB_METRICS], "the lower neighbour instead of the interpolated value"),
    _m("goodput_fraction_of_ok_only", "ab", "pdkv/bench/ab/metrics.py",
       '"goodput_fraction": len(good) / len(rs)', '"goodput_fraction": len(good) / max(1, len(ok))',
       [AB_METRICS], "failed requests left out of the attainment"),
    _m("verdict_without_margin", "ab", "pdkv/bench/ab/verdict.py",
       'wins = good["disagg"] > MARGIN * good[best_col]', 'wins = good["disagg"] > good[best_col]',
       [AB_VERDICT], "any goodput gain, however small, adopts disaggregation"),
    _m("verdict_margin_inclusive", "ab", "pdkv/bench/ab/verdict.py",
       'wins = good["disagg"] > MARGIN * good[best_col]', 'wins = good["disagg"] >= MARGIN * good[best_col]',
       [AB_VERDICT], "exactly 5% counts as beating the margin"),
    # ---- speculative decoding ------------------------------------------------------------------
    _m("bonus_from_last_draft_row", "spec", "pdkv/engine/spec/verify.py",
       "out.append(self._draw(probs[len(drafts)], gen))", "out.append(self._draw(probs[len(drafts) - 1], gen))",
       [SPEC_SAMPLING + "::test_the_bonus_token_after_every_draft_was_kept_follows_the_next_row"],
       "the bonus token after k accepted drafts drawn from the last draft's row"),
    _m("per_pos_counts_proposed", "spec", "pdkv/engine/spec/stats.py",
       "for i in range(num_accepted):", "for i in range(num_drafts):",
       [SPEC_DRAFT_COUNTS, SPEC_METRICS_NGRAM], "acceptance per position counts every proposed draft"),
    _m("per_pos_only_the_last", "spec", "pdkv/engine/spec/stats.py",
       "        for i in range(num_accepted):\n            self.accepted_per_pos[i] += 1",
       "        if num_accepted:\n            self.accepted_per_pos[num_accepted - 1] += 1",
       [SPEC_DRAFT_COUNTS, SPEC_METRICS_NGRAM], "a step that kept j drafts counts only position j - 1"),
    _m("per_pos_metric_adds_totals", "spec", "server/metrics.py",
       "delta = n - (last[i] if i < len(last) else 0)", "delta = n",
       [SPEC_METRICS_NGRAM], "the /metrics copy adds the engine's running totals again each time"),
    _m("spec_pages_not_distinct", "spec", "pdkv/disagg/messages.py",
       "            if len(set(spec_pages)) != len(spec_pages):\n                raise MessageError(\"spec_pages must be distinct\")",
       "", [SPEC_HOSTILE], "a PREFILL naming one proposer page twice is accepted"),
    _m("spec_pages_bound_inclusive", "spec", "pdkv/disagg/messages.py",
       'spec_pages = _ids(msg.get("spec_pages"), "spec_pages", lim.spec_num_pages,',
       'spec_pages = _ids(msg.get("spec_pages"), "spec_pages", lim.spec_num_pages + 1,',
       [SPEC_HOSTILE], "the proposer page just past the peer's cache is accepted"),
    _m("spec_pages_count_unchecked", "spec", "pdkv/disagg/messages.py",
       "            if len(spec_pages) != len(pages):", "            if not spec_pages:",
       [SPEC_HOSTILE], "spec_pages of another length than the target's pages is accepted"),
    _m("next_token_bool_accepted", "spec", "pdkv/disagg/messages.py",
       "return isinstance(v, int) and not isinstance(v, bool)", "return isinstance(v, int)",
       [SPEC_HOSTILE], "next_token true/false taken as token 1/0 (bool is an int; every integer field)"),
    # ---- the router --------------------------------------------------------------------------
    _m("router_ignores_reported_load", "router", "pdkv/router/nodes.py",
       'return max(self.in_flight, r.get("in_flight", 0), r.get("num_running", 0) + r.get("num_waiting", 0))',
       "return self.in_flight", [ROUTER_LOAD], "a node's load is only what the router itself has in flight"),
    _m("router_load_without_waiting", "router", "pdkv/router/nodes.py",
       'r.get("num_running", 0) + r.get("num_waiting", 0))', 'r.get("num_running", 0))',
       [ROUTER_LOAD], "a node's queued requests are not load"),
    _m("router_ties_do_not_rotate", "router", "pdkv/router/policy.py",
       "start = next(self._rr)", "start = 0", [ROUTER_LOAD], "equally loaded nodes: always the first"),
    _m("router_affine_bound_exclusive", "router", "pdkv/router/policy.py",
       "if owner.load <= mean + self.balance_abs:", "if owner.load < mean + self.balance_abs:",
       [ROUTER_UNITS], "the affine node passed over at exactly the bound"),
    # ---- grants on tcp (the receiver's range check; verbs has the NIC's) -------------------------
    _m("grant_ranges_one_page_too_many", "grants", "pdkv/disagg/grants.py",
       "out += [Range(key, base + first * self.g.page_nbytes, count * self.g.page_nbytes)",
       "out += [Range(key, base + first * self.g.page_nbytes, (count + 1) * self.g.page_nbytes)",
       [HOSTILE_TCP], "a request's grant covers the page after its pages (another request's)"),
    _m("slot_freed_without_revoking", "grants", "pdkv/disagg/reservation.py",
       "self._revoke(list(self.grants), pages, then)", "self._revoke([], pages, then)",
       [HOSTILE_TCP], "a request's pages go back while its peer still holds grants on them (stale writes land)"),
    _m("tcp_admit_without_the_length", "grants", "pdkv/csrc/grants.c",
       "if (!r || off - r->off > r->len || len > r->len - (off - r->off)) return -EACCES;",
       "if (!r || off - r->off > r->len) return -EACCES;",
       [GRANTS], "tcp admits a write that starts inside (or at the end of) a range", rebuild=True),
    _m("tcp_revoke_keeps_the_range", "grants", "pdkv/csrc/grants.c",
       "    g->num_ranges--;\n    return 0;\n}\n\nint pdkv_grant_admit", "    return 0;\n}\n\nint pdkv_grant_admit",
       [GRANTS], "tcp's revoke_range reports success and keeps admitting writes", rebuild=True),
    _m("pick_nic_rank_unshifted", "grants", "pdkv/shard/assign.py",
       "return splitmix64(seed ^ splitmix64(rank + 1)) % num_nics",
       "return splitmix64(seed ^ splitmix64(rank)) % num_nics",
       [MULTINIC], "another NIC choice than the peer computes (both sides must agree without talking)"),
    # ---- MoE routing, the torch path (bfloat16, model.cpu_kernels false) --------------------------
    _m("moe_softmax_not_renormalised", "moe", "models/moe.py",
       "                weights = weights / weights.sum(-1, keepdim=True)\n            return ids, weights.to(x.dtype)",
       "                pass\n            return ids, weights.to(x.dtype)",
       [MOE_ROUTING], "norm_topk_prob ignored on the softmax path"),
    _m("moe_weights_from_corrected_scores", "moe", "models/moe.py",
       "weights = scores.gather(1, ids)", "weights = choice.gather(1, ids)",
       [MOE_ROUTING], "the selection-only correction bias leaks into the weights"),
    _m("moe_group_scored_by_its_best", "moe", "models/moe.py",
       "group_scores = grouped.topk(2, dim=-1).values.sum(-1)", "group_scores = grouped.max(-1).values",
       [MOE_ROUTING], "a group scored by its best expert instead of its two best"),
    _m("moe_without_routed_scaling", "moe", "models/moe.py",
       "return ids, (weights * m.routed_scaling_factor).to(x.dtype)", "return ids, weights.to(x.dtype)",
       [MOE_ROUTING], "routed_scaling_factor dropped"),
    _m("moe_bias_ignored_in_selection", "moe", "models/moe.py",
       "choice = scores + self.e_score_correction_bias if m.correction_bias else scores", "choice = scores",
       [MOE_ROUTING], "experts chosen by the uncorrected scores"),
]
