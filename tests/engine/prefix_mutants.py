"""Deliberately broken variants of the prefix cache, each of which tests/engine/test_prefix_properties.py
must catch (not a test: run by hand from the repo root with PYTHONPATH=$PWD):

    python tests/engine/prefix_mutants.py NAME     (NAME: a key of MUT, or all)

It edits the source, runs the property test once without shrinking, and restores the files with git checkout.
"""
import subprocess
import sys

MUT = {
 "publish_partial_page": [("pdkv/engine/prefix_reuse.py",
                           "full = min(min(req.num_computed_tokens, req.num_tokens) // self.page_size, len(req.pages))",
                           "full = min(-(-min(req.num_computed_tokens, req.num_tokens) // self.page_size), len(req.pages))")],
 "publish_remote_early": [("pdkv/kv/allocator.py", "        if self._pinned[page]:\n            raise PageStateError(f\"page {page} is pinned",
                           "        if False:\n            raise PageStateError(f\"page {page} is pinned"),
                          ("pdkv/engine/scheduler.py", "        self.remote[req.request_id] = req\n        return req.pages",
                           "        self.remote[req.request_id] = req\n        req.num_computed_tokens += num_tokens\n        self.publish(req)\n        req.num_computed_tokens -= num_tokens\n        return req.pages")],
 "revive_stays_evictable": [("pdkv/kv/allocator.py", "            if self._refs[p] == 0:\n                del self._evictable[p]\n", "")],
 "evict_before_free": [("pdkv/kv/allocator.py", "            if self._free:\n                p = self._free.pop()", "            if self._free and not self._evictable:\n                p = self._free.pop()")],
 "cached_page_leaks": [("pdkv/kv/allocator.py", "                if self._cached[p]:\n                    self._evictable[p] = None", "                if self._cached[p]:\n                    pass")],
 "hash_not_chained": [("pdkv/kv/prefix_cache.py", "        h = hashlib.blake2b(parent, digest_size=16)", "        h = hashlib.blake2b(salt, digest_size=16)")],
 "reuse_last_token_page": [("pdkv/engine/prefix_reuse.py", "        pages = self.cache.acquire(self._hashes(req, req.num_tokens - 1))\n        req.pages = pages\n        req.num_computed_tokens = req.num_cached_tokens = len(pages) * self.page_size",
   "        pages = self.cache.acquire(self._hashes(req, req.num_tokens))\n        req.pages = pages\n        req.num_computed_tokens = req.num_cached_tokens = min(len(pages) * self.page_size, req.num_tokens - 1)")],
 "unreuse_leaks_pages": [("pdkv/engine/prefix_reuse.py", "        self.allocator.free(req.pages)  # back to the LRU pool, contents kept", "        pass")],
 "reuse_whole_sequence": [("pdkv/engine/prefix_reuse.py", "        pages = self.cache.acquire(self._hashes(req, req.num_tokens - 1))", "        pages = self.cache.acquire(self._hashes(req, req.num_tokens))")],
}
# No shrinking, no example database: a fresh search each time, failing fast.
CODE = ("import sys; sys.path.insert(0, '.'); from hypothesis import settings, Phase; "
        "settings.register_profile('m', phases=[Phase.generate], database=None); settings.load_profile('m'); "
        "import tests.engine.test_prefix_properties as m; m.test_prefix_cache_invariants(); print('1 passed')")


def run(name: str) -> bool:
    """Applies mutant ``name``, runs the property test, restores the files; True if it was caught."""
    edited = []
    try:
        for path, old, new in MUT[name]:
            with open(path) as f:
                s = f.read()
            assert s.count(old) == 1, (name, path, old)
            with open(path, "w") as f:
                f.write(s.replace(old, new))
            edited.append(path)
        r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
        out = (r.stdout + r.stderr).splitlines()
        lines = [x for x in out if "Error" in x or "assert" in x.lower()]
        print(f"== {name}: {'caught' if r.returncode else 'NOT CAUGHT'}")
        for x in (lines or out)[-2:]:
            print("   ", x[:200])
        return r.returncode != 0
    finally:
        if edited:
            subprocess.run(["git", "checkout", "--", *edited], check=True)


if __name__ == "__main__":
    names = list(MUT) if sys.argv[1:] == ["all"] else sys.argv[1:]
    sys.exit(0 if all([run(n) for n in names]) else 1)
