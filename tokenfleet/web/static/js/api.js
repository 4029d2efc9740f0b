// The gateway's HTTP API as the pages use it: JSON calls and streams, errors in OpenAI's shape as ApiError (with the
// retry time of a 429), a connection that failed as NetworkError.

export class ApiError extends Error {
  constructor(status, error, headers) {
    super((error && error.message) || `the gateway answered ${status}`);
    this.name = "ApiError";
    this.status = status;
    this.code = (error && error.code) || null;
    this.type = (error && error.type) || null;
    this.param = (error && error.param) || null;
    this.retryAfterS = retryAfterSeconds(headers);
  }
}

export class NetworkError extends Error {
  constructor(message = "cannot reach the gateway") {
    super(message);
    this.name = "NetworkError";
  }
}

export function retryAfterSeconds(headers) {
  if (!headers) return null;
  const ms = headers.get("retry-after-ms");
  if (ms && /^[0-9]+$/.test(ms)) return Number(ms) / 1000;
  const seconds = headers.get("retry-after");
  if (seconds && /^[0-9]+$/.test(seconds)) return Number(seconds);
  return null;
}

export class Api {
  // key(): the bearer key to send, or null; onUnauthorized(error): a 401 came back (a wrong or revoked key)
  constructor({ key = () => null, onUnauthorized = () => {} } = {}) {
    this.key = key;
    this.onUnauthorized = onUnauthorized;
  }

  async request(method, path, { body, headers = {}, signal, anonymous = false } = {}) {
    const sent = { ...headers };
    const key = anonymous ? null : this.key();
    if (key) sent.authorization = `Bearer ${key}`;
    if (body !== undefined) sent["content-type"] = "application/json";
    let response;
    try {
      response = await fetch(path, {
        method,
        headers: sent,
        body: body === undefined ? undefined : JSON.stringify(body),
        signal,
        cache: "no-store",
      });
    } catch (error) {
      if (error && error.name === "AbortError") throw error;
      throw new NetworkError();
    }
    if (!response.ok) {
      let error = null;
      try {
        error = (await response.json()).error;
      } catch {
        // not JSON: a proxy's page; the status says enough
      }
      const failure = new ApiError(response.status, error, response.headers);
      if (response.status === 401 && !anonymous) this.onUnauthorized(failure);
      throw failure;
    }
    return response;
  }

  async json(method, path, body, options = {}) {
    const response = await this.request(method, path, { ...options, body });
    return response.json();
  }

  get(path, options) {
    return this.json("GET", path, undefined, options);
  }
}
