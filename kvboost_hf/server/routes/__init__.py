"""The FastAPI app and its routes, the request handling behind them (validation, planning, queueing,
warming, replies and their SSE stream), serving in a background thread."""
