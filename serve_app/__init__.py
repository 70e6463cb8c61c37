
# This folder is the package inflight.serve_app (pyproject.toml): imported under the folder's name too, it would be a
# second copy of every module, with state of its own.
if __name__ == "serve_app":
    raise ImportError("import inflight.serve_app, not serve_app (the folder installs as inflight.serve_app)")
