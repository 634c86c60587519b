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
    """How the package handles one kind of array (numpy in epx.numpy_frontend, torch in
    epx.torch.frontend): what both kinds do alike."""

    name = ""
    array_type: type = object  # the arrays it handles
    code_table: tuple = ()  # (dtype, the epx dtypes it may stand for) pairs

    def is_array(self, a) -> bool:
        return isinstance(a, self.array_type)

    def codes(self, a) -> Tuple[DType, ...]:
        """The epx dtypes an array may stand for (uint8 is a bool map or fp8 bits)."""
        return _dtype_codes(a.dtype, self.code_table)

    @staticmethod
    def dtype_name(a) -> str:
        return str(a.dtype)

    @staticmethod
    def shape(a) -> tuple:
        return tuple(a.shape)

    @staticmethod
    def reshape(a, shape):
        return a.reshape(shape)

    @staticmethod
    def slice_rows(a, n):
        return a[:n]
