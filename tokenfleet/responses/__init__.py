"""The Responses API (`/v1/responses`): OpenAI's newer API for apps and agents, served by the same gateway path as
chat completions (quota, tiers, metering, resume, cancel), with responses stored for previous_response_id."""
