"""The two workload classes (long_single, multi_request) and where their prompts come from."""

from moecache.workloads.build import Conversation, build_conversations, encode_messages

__all__ = ["Conversation", "build_conversations", "encode_messages"]
