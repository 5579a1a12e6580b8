"""The proxy in front of llama-server: the aiohttp app (app), reading and checking a
request (checks), its errors, the X-Warmslot-* headers, reading answers (stream), the
request's types, /metrics and the one edit of a body (tool_arguments).
"""
