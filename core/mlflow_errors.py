"""MLflow's error shape: ``{"error_code": "RESOURCE_DOES_NOT_EXIST", "message": ...}`` with MLflow's HTTP status;
the official client branches on the code (a missing experiment makes ``set_experiment`` create it)."""

from __future__ import annotations

from typing import Any


class MlflowError(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    def body(self) -> dict[str, Any]:
        return {"error_code": self.code, "message": self.message}

    @classmethod
    def invalid(cls, message: str) -> MlflowError:
        return cls(400, "INVALID_PARAMETER_VALUE", message)

    @classmethod
    def missing(cls, message: str) -> MlflowError:
        return cls(404, "RESOURCE_DOES_NOT_EXIST", message)

    @classmethod
    def exists(cls, message: str) -> MlflowError:
        return cls(400, "RESOURCE_ALREADY_EXISTS", message)

    @classmethod
    def denied(cls, message: str) -> MlflowError:
        return cls(403, "PERMISSION_DENIED", message)
