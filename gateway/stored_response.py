"""A response the gateway stored for a model of kvgate's workers, as it is kept in memory
(gateway/response_store.py) and in Redis (gateway/shared_response_store.py)."""

import json
from dataclasses import dataclass

from gateway.response_ids import valid_id
from gateway.response_request import Message

MAX_TENANT_CHARS = 256


@dataclass(frozen=True)
class StoredResponse:
    """A stored response: its id, the tenant whose key made it ("" without API keys), the
    Response object as answered, and its conversation: the chain's input items (never its
    instructions) and its own output message, which a follow-up's prompt starts with."""

    response_id: str
    tenant: str
    response: dict
    conversation: tuple[Message, ...]

    def to_json(self) -> dict:
        return {
            "id": self.response_id,
            "tenant": self.tenant,
            "response": self.response,
            "conversation": [m.to_json() for m in self.conversation],
        }

    def encoded(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    @staticmethod
    def from_json(d: dict) -> "StoredResponse":
        """ValueError unless `d` is a record as `to_json` writes one."""
        rid, tenant, response, conversation = (d.get(k) for k in ("id", "tenant", "response", "conversation"))
        if not isinstance(rid, str) or not valid_id(rid):
            raise ValueError("its id is not a response id")
        if not isinstance(tenant, str) or len(tenant) > MAX_TENANT_CHARS:
            raise ValueError("its tenant is not a string of at most 256 characters")
        if not isinstance(response, dict) or response.get("id") != rid or response.get("object") != "response":
            raise ValueError("its response is not the Response object of its id")
        if not isinstance(conversation, list):
            raise ValueError("its conversation is not a list")
        return StoredResponse(rid, tenant, response, tuple(Message.from_json(m) for m in conversation))
