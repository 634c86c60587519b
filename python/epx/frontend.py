"""The interface of an array frontend: how the package handles one kind of array (numpy in
:mod:`epx.numpy_frontend`, torch in :mod:`epx.torch`). Both expose the same small interface,
so the shape/dtype checks (:mod:`epx.arrays`) and the output allocation are written once."""

from __future__ import annotations

from typing import Tuple

from ._lib import DType


def _dtype_codes(d, table) -> Tuple[DType, ...]:
    """The epx dtypes a frontend's dtype stands for, from its (dtype, codes) table."""
    for dt, codes in table:
        if dt is not None and d == dt:
            return codes
    return ()


class _Frontend:
    """How the package handles one kind of array (numpy here, torch in epx.torch): what both
    kinds do alike."""

    @staticmethod
    def reshape(a, shape):
        return a.reshape(shape)

    @staticmethod
    def slice_rows(a, n):
        return a[:n]
