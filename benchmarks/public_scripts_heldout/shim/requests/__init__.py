"""A local stand-in for `requests.get(url, stream=True)` (no network here): the gcn example downloads Cora's
tarball; this serves the synthetic one at $PS_CORA_TGZ (tools/make_cora.py) for any URL ending in cora.tgz."""
import os


class _Response:
    def __init__(self, path):
        self.raw = open(path, "rb")
        self.status_code = 200

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.raw.close()


def get(url, stream=False, **kw):
    if not url.endswith("cora.tgz"):
        raise RuntimeError(f"requests shim: no network, and no local copy of {url}")
    return _Response(os.environ["PS_CORA_TGZ"])
