// Server-Sent Events read from a fetch response (EventSource can neither POST nor send an Authorization header).
// Yields {id, event, data} per event; heartbeats (": ping") only keep the watchdog quiet. A connection that goes
// silent for longer than `silenceMs` is given up (the caller reconnects): a cut cable sends no reset.

export async function* sseEvents(response, { silenceMs = 45000, signal } = {}) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let timer = null;
  const arm = () => {
    clearTimeout(timer);
    timer = setTimeout(() => reader.cancel("silent connection").catch(() => {}), silenceMs);
  };
  const onAbort = () => reader.cancel("aborted").catch(() => {});
  if (signal) signal.addEventListener("abort", onAbort);
  let buffer = "";
  let pending = { id: null, event: "message", data: [] };
  try {
    arm();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      arm();
      buffer += value;
      let newline;
      while ((newline = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, newline).replace(/\r$/, "");
        buffer = buffer.slice(newline + 1);
        if (line === "") {
          if (pending.data.length) yield { id: pending.id, event: pending.event, data: pending.data.join("\n") };
          pending = { id: null, event: "message", data: [] };
          continue;
        }
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let text = colon < 0 ? "" : line.slice(colon + 1);
        if (text.startsWith(" ")) text = text.slice(1);
        if (field === "data") pending.data.push(text);
        else if (field === "event") pending.event = text;
        else if (field === "id") pending.id = text;
      }
    }
  } finally {
    clearTimeout(timer);
    if (signal) signal.removeEventListener("abort", onAbort);
    reader.releaseLock();
  }
}
