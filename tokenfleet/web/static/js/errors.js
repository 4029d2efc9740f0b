// API errors in words a person understands, with what they can do about it.
import { ApiError, NetworkError } from "./api.js";

export function explain(error) {
  if (error instanceof NetworkError) {
    return "Can't reach the server. Check your connection; the page keeps trying.";
  }
  if (!(error instanceof ApiError)) return `Something went wrong: ${error && error.message ? error.message : error}`;
  const { status, code } = error;
  if (status === 429 && code === "request_too_large") {
    return "This message needs more tokens than your plan allows at once. Lower Max tokens or shorten the message.";
  }
  if (status === 429 && code === "high_demand") {
    return "The service is very busy right now.";
  }
  if (status === 429) return "You've reached your rate limit.";
  if (code === "context_length_exceeded") {
    return "This message is too long for the model's context window. Shorten it, lower Max tokens, or start a new chat.";
  }
  if (code === "content_filter") return "The safety check blocked this message. Rephrase it and try again.";
  if (code === "no_replica" || status === 503) {
    return "No model server is available right now. Try again in a moment.";
  }
  if (status === 401) return "Your API key was not accepted: it may have been revoked. Sign in again.";
  if (code === "message_too_large" || status === 413) return "This message is too long to send.";
  if (code === "model_not_found") return "That model is not served here any more. Pick another one.";
  if (code === "model_deprecated") return "That model version has been retired. Pick another one.";
  if (status === 404) return "That conversation no longer exists.";
  if (status === 409) return error.message;
  if (status >= 500) return `The server failed: ${error.message}`;
  return error.message;
}

// a reply that ended failed, or an `error` event in its stream
export function explainReplyError(message) {
  if (!message) return "The reply failed. Regenerate it.";
  if (/no replica/i.test(message)) return "No model server is available right now. Regenerate the reply in a moment.";
  return `The reply failed: ${message}`;
}
