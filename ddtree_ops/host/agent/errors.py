"""What the agent reports as a refusal (the controller gets its text, never a traceback)."""


class AgentError(Exception):
    pass
