"""The only place third-party code is patched; each patch is pinned to versions, applied explicitly, and tested."""
