"""How ISAGI's own linear algebra shares the CPU with the model engine.

Owns one setting: numpy's and FAISS's OpenBLAS run on one thread while a
model engine is loaded. ISAGI's own matrices are small (a k x k metric, a
few hundred 576-float vectors), so extra BLAS threads never pay for
themselves there; but after every call OpenBLAS's idle threads busy-wait for
more work for a while. On a 2-core machine they then hold the cores that the
model engine's threads need, and a llama.cpp prefill right after a new
session's metric eigendecomposition is much slower (``isagi bench turn``;
the figures are in docs/measurements.md).

``threadpoolctl`` sets the limit in the loaded libraries, so FAISS is
imported first to have its OpenBLAS included. torch's own thread pool
(the transformers engine's) is not touched.
"""

from __future__ import annotations


def keep_blas_single_threaded() -> None:
    """Limit every OpenBLAS loaded now (numpy's, FAISS's, and any other) to one thread.

    Called at each engine load (a few ms); a library loaded later (scipy's, for
    calibration) keeps its own setting.
    """
    import faiss  # noqa: F401  (loads FAISS's OpenBLAS so the limit reaches it)
    import numpy  # noqa: F401
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")
