"""MLflow's error shape: ``{"error_code": "RESOURCE_DOES_NOT_EXIST", "message": ...}`` with MLflow's HTTP status;
the official client branches on the code (a missing experiment makes ``set_experiment`` create it)."""

from __future__ import annotations

from typing import Any, Literal

MlflowCode = Literal[
    "INVALID_PARAMETER_VALUE",
    "RESOURCE_DOES_NOT_EXIST",
    "RESOURCE_ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "ENDPOINT_NOT_FOUND",
]

# The code decides the status, as in MLflow itself (``mlflow.exceptions.ERROR_CODE_TO_HTTP_STATUS``), so no call
# site can pair a code with another status.
HTTP_STATUS: dict[MlflowCode, int] = {
    "INVALID_PARAMETER_VALUE": 400,
    "RESOURCE_DOES_NOT_EXIST": 404,
    "RESOURCE_ALREADY_EXISTS": 400,
    "PERMISSION_DENIED": 403,
    "ENDPOINT_NOT_FOUND": 404,
}


class MlflowError(Exception):
    """``MlflowError(message)`` is a bad parameter, the store's usual refusal; any other answer names its ``code``
    (as MLflow's own ``MlflowException(message, error_code=...)``)."""

    def __init__(self, message: str, code: MlflowCode = "INVALID_PARAMETER_VALUE"):
        super().__init__(message)
        self.status, self.code, self.message = HTTP_STATUS[code], code, message

    def body(self) -> dict[str, Any]:
        return {"error_code": self.code, "message": self.message}
