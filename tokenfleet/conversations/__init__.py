"""The conversations API of the chat product: conversations and their messages in SQL, the prompt built from the
history to fit the model's window, and replies generated through the gateway, saved while they stream."""
