"""Example black-box agent: plays guess-the-number through the ordinary OpenAI client.

The executor gives every sample its own ``base_url``; the agent never sees tokens. It returns
its reward (1.0 if it found the secret number, which is the row's label).
"""

import re

from openai import AsyncOpenAI


async def agent(base_url, prompt, label, max_turns=4):
    client = AsyncOpenAI(base_url=base_url, api_key="unused")
    secret = int(label)
    messages = [{"role": "user", "content": prompt}]
    try:
        for turn in range(max_turns):
            reply = await client.chat.completions.create(
                model="policy", messages=messages, max_tokens=6, temperature=1.0
            )
            text = reply.choices[0].message.content
            messages.append({"role": "assistant", "content": text})
            found = re.findall(r"-?\d+", text)
            if found and int(found[-1]) == secret:
                return {"reward": 1.0, "metrics": {"turns": turn + 1}}
            hint = "Too low." if found and int(found[-1]) < secret else "Too high."
            messages.append({"role": "user", "content": hint if found else "Answer with a number."})
        return {"reward": 0.0, "metrics": {"turns": max_turns}}
    finally:
        await client.close()
