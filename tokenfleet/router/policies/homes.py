"""Where each conversation lives: its x-conversation-id -> the replica its first turn ran on, then the replica its
latest turn ran on (a turn moved by the load bound, or because its replica left, moves its history too).

Bounded: the least recently seen conversations are forgotten first. A forgotten conversation's next turn still finds
its history through the prefix index, so the bound costs little."""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_CONVERSATIONS = 100_000  # ~100 bytes each


class ConversationHomes:
    def __init__(self, max_conversations: int = DEFAULT_CONVERSATIONS) -> None:
        if max_conversations < 1:
            raise ValueError("max_conversations must be at least 1")
        self.max_conversations = max_conversations
        self._homes: OrderedDict[str, str] = OrderedDict()  # LRU order: front is forgotten first

    def __len__(self) -> int:
        return len(self._homes)

    def get(self, conversation: str) -> str | None:
        """The replica the conversation's last turn ran on, or None for one never seen (or forgotten)."""
        return self._homes.get(conversation)

    def settle(self, conversation: str, replica: str) -> None:
        """The conversation's latest turn runs on `replica`."""
        self._homes[conversation] = replica
        self._homes.move_to_end(conversation)
        if len(self._homes) > self.max_conversations:
            self._homes.popitem(last=False)

    def forget(self, replica: str) -> None:
        """The replica left the pool: its conversations are placed anew on their next turn."""
        for conversation in [c for c, r in self._homes.items() if r == replica]:
            del self._homes[conversation]
