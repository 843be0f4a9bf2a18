"""The one error the counting layer raises for requests it cannot account for."""

from __future__ import annotations


class MalformedRequest(ValueError):
    """The request body does not have the shape of an OpenAI chat or completions request.

    ``message`` names the offending field the way OpenAI does
    (``messages[3].content must be a string or an array of content parts``) so the
    admission path can return it verbatim as ``{"error": {"message", "type", "code"}}``
    with status 400.
    """

    error_type = "invalid_request_error"
    status = 400

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code

    def to_openai_error(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.error_type, "code": self.code}}
