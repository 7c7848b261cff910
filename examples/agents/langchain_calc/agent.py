"""A calc agent written with LangChain (``langchain-openai``'s ``ChatOpenAI.bind_tools``), as a user
would write one, for a harness env's ``agent_folder``: it runs in the sandbox with its requirements
installed by the env service (``requirements.txt``), configured only with the OPENAI_* variables.

In: ``{"messages", "tools", "max_turns"}`` on stdin. Each turn invokes the model with the dialogue
so far, answers its tool calls with calc's arithmetic (``arith.py``, which the calc task puts beside
it in the job) and stops at a reply without calls; a request refused because the dialogue outgrew
its token budget (HTTP 400, ``context_length_exceeded``) ends the episode cut. Out: the harness's
report line."""

import json
import os
import sys


def main() -> None:
    import arith
    import openai
    from langchain_core.messages import ToolMessage
    from langchain_openai import ChatOpenAI

    spec = json.load(sys.stdin)
    llm = ChatOpenAI(
        model=os.environ["OPENAI_MODEL"],
        base_url=os.environ["OPENAI_BASE_URL"],
        api_key=os.environ["OPENAI_API_KEY"],
        max_retries=0,
        timeout=120,
    ).bind_tools(spec["tools"])
    history = list(spec["messages"])
    report = {"final": None, "turns": 0, "tool_calls": 0, "truncated": False}
    for _ in range(spec["max_turns"]):
        try:
            reply = llm.invoke(history)
        except openai.BadRequestError as e:
            if e.code != "context_length_exceeded":  # the episode's token budget is spent:
                raise
            report["truncated"] = True  # cut, without an answer, as OpenAI's own limit ends one
            break
        report["turns"] += 1
        history.append(reply)
        if reply.response_metadata.get("finish_reason") == "length":
            report["truncated"] = True
            break
        if not reply.tool_calls:
            report["final"] = reply.content
            break
        for call in reply.tool_calls:
            report["tool_calls"] += 1
            try:
                result = arith.format_number(arith.evaluate(call["args"]["expression"]))
            except Exception as e:  # the model's bad expression: an observation, as calc words it
                result = f"error: {e}"
            history.append(ToolMessage(content=result, tool_call_id=call["id"], name=call["name"]))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
