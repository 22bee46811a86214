"""Tests for engine.chat_template (OpenAI messages -> prompt via the GGUF chat template).

Reference data:

* ``LLAMA_CPP_CASES``: templates and expected ``--jinja`` outputs copied from
  ik_llama.cpp's ``tests/test-chat-template.cpp`` (the conversation is its
  ``conversation`` vector; the expected text is ``expected_output_jinja`` where
  given, else ``expected_output``).
* DeepSeek-R1, Llama-3.2 and Qwen2.5 templates: ik_llama.cpp's
  ``models/templates/*.jinja`` (the HF ``tokenizer_config.json`` templates).
* DeepSeek-V3: the ``tokenizer_config.json`` template of deepseek-ai/DeepSeek-V3-0324,
  transcribed from memory (no copy of it is in ik_llama.cpp; its logic matches the
  R1 template there plus the V3 multi-system-message join).
* Expected outputs of the non-llama.cpp cases are written by hand from the
  templates' text, not produced by the code under test.
"""
from __future__ import annotations

import datetime
import pathlib

import pytest

pytest.importorskip("jinja2")

from engine import chat_template as ct  # noqa: E402
from engine.chat_template import render_chat  # noqa: E402

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "Who are you"},
    {"role": "assistant", "content": "   I am an assistant   "},
    {"role": "user", "content": "Another question"},
]
# the brief's system + user + assistant + user conversation
SHORT = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "Who are you"},
]

DS_BOS = "<｜begin▁of▁sentence｜>"
DS_EOS = "<｜end▁of▁sentence｜>"

# ---------------------------------------------------------------------------
# real-world templates
# ---------------------------------------------------------------------------
# deepseek-ai/DeepSeek-V2-Chat / DeepSeek-V2-Lite-Chat (also tests/test-chat-template.cpp "DeepSeek-V2")
DEEPSEEK_V2 = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ 'User: ' + message['content'] + '\\n\\n' }}{% elif message['role'] == 'assistant' %}"
    "{{ 'Assistant: ' + message['content'] + eos_token }}{% elif message['role'] == 'system' %}"
    "{{ message['content'] + '\\n\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ 'Assistant:' }}{% endif %}"
)

# deepseek-ai/DeepSeek-V3-0324 tokenizer_config.json (transcribed from memory, see module docstring)
DEEPSEEK_V3 = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}"
    "{%- else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}"
    "{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}"
    "{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and 'tool_calls' in message %}{%- set ns.is_tool = false -%}"
    "{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}{%- if message['content'] is none %}"
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{%- else %}"
    "{{'<｜Assistant｜>' + message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{%- endif %}{%- set ns.is_first = true -%}{%- else %}"
    "{{'\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{%- endif %}{%- endfor %}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and 'tool_calls' not in message %}{%- if ns.is_tool %}"
    "{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}"
    "{%- else %}{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}"
    "{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}"
    "{%- set ns.is_output_first = false %}{%- else %}"
    "{{'<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}"
    "{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}"
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"
)

# deepseek-ai/DeepSeek-R1 (ik_llama.cpp models/templates/deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja)
DEEPSEEK_R1 = r"""{% if not add_generation_prompt is defined -%}
  {%- set add_generation_prompt = false -%}
{%- endif -%}
{%- set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') -%}
{%- for message in messages -%}
  {%- if message['role'] == 'system' -%}
    {%- set ns.system_prompt = message['content'] -%}
  {%- endif -%}
{%- endfor -%}{{bos_token}}{{ns.system_prompt}}
{%- for message in messages -%}
  {%- if message['role'] == 'user' -%}
    {%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}
  {%- endif -%}
  {%- if message['role'] == 'assistant' and message['content'] is none -%}
    {%- set ns.is_tool = false -%}
    {%- for tool in message['tool_calls']-%}
      {%- if not ns.is_first -%}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}
        {%- set ns.is_first = true -%}
        {%- else -%}{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
  {%- if message['role'] == 'assistant' and message['content'] is not none -%}
    {%- if ns.is_tool -%}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}
      {%- set ns.is_tool = false -%}
      {%- else -%}
      {%- set content = message['content'] -%}
      {%- if '</think>' in content -%}
        {%- set content = content.split('</think>')[-1] -%}
      {%- endif -%}{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}
    {%- endif -%}
  {%- endif -%}
  {%- if message['role'] == 'tool' -%}
    {%- set ns.is_tool = true -%}
    {%- if ns.is_output_first -%}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}
      {%- set ns.is_output_first = false -%}
      {%- else -%}{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}
    {%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if ns.is_tool -%}{{'<｜tool▁outputs▁end｜>'}}
{%- endif -%}
{%- if add_generation_prompt and not ns.is_tool -%}{{'<｜Assistant｜><think>\n'}}
{%- endif %}
"""

# meta-llama/Meta-Llama-3-8B-Instruct tokenizer_config.json
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# meta-llama/Llama-3.2-3B-Instruct (ik_llama.cpp models/templates/meta-llama-Llama-3.2-3B-Instruct.jinja)
LLAMA32 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Qwen/Qwen2.5-7B-Instruct, ChatML (ik_llama.cpp models/templates/Qwen-Qwen2.5-7B-Instruct.jinja)
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# ---------------------------------------------------------------------------
# ik_llama.cpp tests/test-chat-template.cpp: (template, expected --jinja output, bos, eos)
# ---------------------------------------------------------------------------
LLAMA_CPP_CASES = [  # noqa: E501
    pytest.param(
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        '<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nWho are you<|im_end|>\n<|im_start|>assistant\n   I am an assistant   <|im_end|>\n<|im_start|>user\nAnother question<|im_end|>\n<|im_start|>assistant\n',
        '', '',
        id='teknium/OpenHermes-2.5-Mistral-7B',
    ),
    pytest.param(
        "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}",
        '[INST] You are a helpful assistant\nHello [/INST]Hi there</s>[INST] Who are you [/INST]   I am an assistant   </s>[INST] Another question [/INST]',
        '', '</s>',
        id='mistralai/Mistral-7B-Instruct-v0.2',
    ),
    pytest.param(
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}{% elif true == true and not '<<SYS>>' in messages[0]['content'] %}{% set loop_messages = messages %}{% set system_message = 'Vous êtes Vigogne, un assistant IA créé par Zaion Lab. Vous suivez extrêmement bien les instructions. Aidez autant que vous le pouvez.' %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'system' %}{{ '<<SYS>>\\n' + content.strip() + '\\n<</SYS>>\\n\\n' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}",
        '[INST] <<SYS>>\nYou are a helpful assistant\n<</SYS>>\n\nHello [/INST] Hi there </s>[INST] Who are you [/INST] I am an assistant </s>[INST] Another question [/INST]',
        '', '</s>',
        id='bofenghuang/vigogne-2-70b-chat',
    ),
    pytest.param(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}",
        '<start_of_turn>user\nYou are a helpful assistant\nHello<end_of_turn>\n<start_of_turn>model\nHi there<end_of_turn>\n<start_of_turn>user\nWho are you<end_of_turn>\n<start_of_turn>model\nI am an assistant<end_of_turn>\n<start_of_turn>user\nAnother question<end_of_turn>\n<start_of_turn>model\n',
        '', '',
        id='google/gemma-7b-it',
    ),
    pytest.param(
        "{% for message in messages %}{% if loop.first %}{{ bos_token }}{% endif %}{% if message['role'] == 'user' %}{{ 'Human: ' + message['content'] + '\\n\\nAssistant: ' + eos_token }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}",
        'Human: You are a helpful assistant\nHello\n\nAssistant: </s>Hi there</s>Human: Who are you\n\nAssistant: </s>   I am an assistant   </s>Human: Another question\n\nAssistant: </s>',
        '', '</s>',
        id='OrionStarAI/Orion-14B-Chat',
    ),
    pytest.param(
        "{% if not add_generation_prompt is defined %}\n{% set add_generation_prompt = false %}\n{% endif %}\n{%- set ns = namespace(found=false) -%}\n{%- for message in messages -%}\n    {%- if message['role'] == 'system' -%}\n        {%- set ns.found = true -%}\n    {%- endif -%}\n{%- endfor -%}\n{{bos_token}}{%- if not ns.found -%}\n{{'You are an AI programming assistant, utilizing the Deepseek Coder model, developed by Deepseek Company, and you only answer questions related to computer science. For politically sensitive questions, security and privacy issues, and other non-computer science questions, you will refuse to answer\\n'}}\n{%- endif %}\n{%- for message in messages %}\n    {%- if message['role'] == 'system' %}\n{{ message['content'] }}\n    {%- else %}\n        {%- if message['role'] == 'user' %}\n{{'### Instruction:\\n' + message['content'] + '\\n'}}\n        {%- else %}\n{{'### Response:\\n' + message['content'] + '\\n<|EOT|>\\n'}}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n{% if add_generation_prompt %}\n{{'### Response:'}}\n{% endif %}",
        'You are a helpful assistant### Instruction:\nHello\n### Response:\nHi there\n<|EOT|>\n### Instruction:\nWho are you\n### Response:\n   I am an assistant   \n<|EOT|>\n### Instruction:\nAnother question\n### Response:\n',
        '', '',
        id='deepseek-ai/deepseek-coder-33b-instruct',
    ),
    pytest.param(
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}{% elif false == true %}{% set loop_messages = messages %}{% set system_message = 'You are Command-R, a brilliant, sophisticated, AI-assistant trained to assist human users by providing thorough responses. You are trained by Cohere.' %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% if system_message != false %}{{ '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>' + system_message + '<|END_OF_TURN_TOKEN|>' }}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% set content = message['content'] %}{% if message['role'] == 'user' %}{{ '<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' + content.strip() + '<|END_OF_TURN_TOKEN|>' }}{% elif message['role'] == 'assistant' %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>'  + content.strip() + '<|END_OF_TURN_TOKEN|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{% endif %}",
        '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a helpful assistant<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hello<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Who are you<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>I am an assistant<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Another question<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>',
        '', '',
        id='CohereForAI/c4ai-command-r-plus',
    ),
    pytest.param(
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}",
        '<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWho are you<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nI am an assistant<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nAnother question<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n',
        '', '',
        id='Llama-3',
    ),
    pytest.param(
        "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') %}{{'<|user|>' + '\n' + message['content'] + '<|end|>' + '\n' + '<|assistant|>' + '\n'}}{% elif (message['role'] == 'assistant') %}{{message['content'] + '<|end|>' + '\n'}}{% endif %}{% endfor %}",
        '<|user|>\nYou are a helpful assistant\nHello<|end|>\n<|assistant|>\nHi there<|end|>\n<|user|>\nWho are you<|end|>\n<|assistant|>\n   I am an assistant   <|end|>\n<|user|>\nAnother question<|end|>\n<|assistant|>\n',
        '', '',
        id='Phi-3-mini',
    ),
    pytest.param(
        "[gMASK]<sop>{% for item in messages %}{% if item['tools'] is defined %}<|system|>\n你是一个名为 ChatGLM 的人工智能助手。你是基于智谱AI训练的语言模型 GLM-4 模型开发的，你的任务是针对用户的问题和要求提供适当的答复和支持。\n\n# 可用工具{% set tools = item['tools'] %}{% for tool in tools %}{% if tool['type'] == 'function' %}\n\n## {{ tool['function']['name'] }}\n\n{{ tool['function'] | tojson(indent=4) }}\n......{% endif %}{% endfor %}{% endif %}{% if item['content'] %}<|{{ item['role'] }}|>{{ item['metadata'] }}\n{{ item['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
        '[gMASK]<sop><|system|>\nYou are a helpful assistant<|user|>\nHello<|assistant|>\nHi there<|user|>\nWho are you<|assistant|>\n   I am an assistant   <|user|>\nAnother question<|assistant|>\n',
        '', '',
        id='ChatGLM4',
    ),
    pytest.param(
        "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n\n' }}{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}{% elif message['role'] == 'system' %}{{ message['content'] + '\n\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}",
        'You are a helpful assistant\n\nUser: Hello\n\nAssistant: Hi there<｜end▁of▁sentence｜>User: Who are you\n\nAssistant:    I am an assistant   <｜end▁of▁sentence｜>User: Another question\n\nAssistant:',
        '', '<｜end▁of▁sentence｜>',
        id='DeepSeek-V2',
    ),
    pytest.param(
        "{%- if tools %}\n    {{- '<|start_of_role|>available_tools<|end_of_role|>\n' }}\n    {%- for tool in tools %}\n    {{- tool | tojson(indent=4) }}\n    {%- if not loop.last %}\n        {{- '\n\n' }}\n    {%- endif %}\n    {%- endfor %}\n    {{- '<|end_of_text|>\n' }}\n{%- endif %}\n{%- for message in messages %}\n    {%- if message['role'] == 'system' %}\n    {{- '<|start_of_role|>system<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' }}\n    {%- elif message['role'] == 'user' %}\n    {{- '<|start_of_role|>user<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' }}\n    {%- elif message['role'] == 'assistant' %}\n    {{- '<|start_of_role|>assistant<|end_of_role|>'  + message['content'] + '<|end_of_text|>\n' }}\n    {%- elif message['role'] == 'assistant_tool_call' %}\n    {{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' + message['content'] + '<|end_of_text|>\n' }}\n    {%- elif message['role'] == 'tool_response' %}\n    {{- '<|start_of_role|>tool_response<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' }}\n    {%- endif %}\n    {%- if loop.last and add_generation_prompt %}\n    {{- '<|start_of_role|>assistant<|end_of_role|>' }}\n    {%- endif %}\n{%- endfor %}",
        '<|start_of_role|>system<|end_of_role|>You are a helpful assistant<|end_of_text|>\n<|start_of_role|>user<|end_of_role|>Hello<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>Hi there<|end_of_text|>\n<|start_of_role|>user<|end_of_role|>Who are you<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>   I am an assistant   <|end_of_text|>\n<|start_of_role|>user<|end_of_role|>Another question<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>',
        '', '',
        id='ibm-granite/granite-3.0-8b-instruct',
    ),
    pytest.param(
        '{%- if messages[0]["role"] == "system" %}\n    {%- set system_message = messages[0]["content"] %}\n    {%- set loop_messages = messages[1:] %}\n{%- else %}\n    {%- set loop_messages = messages %}\n{%- endif %}\n{%- if not tools is defined %}\n    {%- set tools = none %}\n{%- endif %}\n{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}\n\n{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}\n{%- set ns = namespace() %}\n{%- set ns.index = 0 %}\n{%- for message in loop_messages %}\n    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}\n        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}\n            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}\n        {%- endif %}\n        {%- set ns.index = ns.index + 1 %}\n    {%- endif %}\n{%- endfor %}\n\n{{- bos_token }}\n{%- for message in loop_messages %}\n    {%- if message["role"] == "user" %}\n        {%- if tools is not none and (message == user_messages[-1]) %}\n            {{- "[AVAILABLE_TOOLS] [" }}\n            {%- for tool in tools %}\n                {%- set tool = tool.function %}\n                {{- \'{"type": "function", "function": {\' }}\n                {%- for key, val in tool.items() if key != "return" %}\n                    {%- if val is string %}\n                        {{- \'"\' + key + \'": "\' + val + \'"\' }}\n                    {%- else %}\n                        {{- \'"\' + key + \'": \' + val|tojson }}\n                    {%- endif %}\n                    {%- if not loop.last %}\n                        {{- ", " }}\n                    {%- endif %}\n                {%- endfor %}\n                {{- "}}" }}\n                {%- if not loop.last %}\n                    {{- ", " }}\n                {%- else %}\n                    {{- "]" }}\n                {%- endif %}\n            {%- endfor %}\n            {{- "[/AVAILABLE_TOOLS]" }}\n            {%- endif %}\n        {%- if loop.last and system_message is defined %}\n            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}\n        {%- else %}\n            {{- "[INST] " + message["content"] + "[/INST]" }}\n        {%- endif %}\n    {%- elif message.tool_calls is defined and message.tool_calls is not none %}\n        {{- "[TOOL_CALLS] [" }}\n        {%- for tool_call in message.tool_calls %}\n            {%- set out = tool_call.function|tojson %}\n            {{- out[:-1] }}\n            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}\n                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}\n            {%- endif %}\n            {{- \', "id": "\' + tool_call.id + \'"}\' }}\n            {%- if not loop.last %}\n                {{- ", " }}\n            {%- else %}\n                {{- "]" + eos_token }}\n            {%- endif %}\n        {%- endfor %}\n    {%- elif message["role"] == "assistant" %}\n        {{- " " + message["content"]|trim + eos_token}}\n    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}\n        {%- if message.content is defined and message.content.content is defined %}\n            {%- set content = message.content.content %}\n        {%- else %}\n            {%- set content = message.content %}\n        {%- endif %}\n        {{- \'[TOOL_RESULTS] {"content": \' + content|string + ", " }}\n        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}\n            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}\n        {%- endif %}\n        {{- \'"call_id": "\' + message.tool_call_id + \'"}[/TOOL_RESULTS]\' }}\n    {%- else %}\n        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}\n    {%- endif %}\n{%- endfor %}\n',
        '[INST] Hello[/INST] Hi there</s>[INST] Who are you[/INST] I am an assistant</s>[INST] You are a helpful assistant\n\nAnother question[/INST]',
        '', '</s>',
        id='Mistral-Large-Instruct-2407',
    ),
    pytest.param(
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|role_start|>system<|role_end|>你是Megrez-3B-Instruct，将针对用户的问题给出详细的、积极的回答。<|turn_end|>' }}{% endif %}{{ '<|role_start|>' + message['role'] + '<|role_end|>' + message['content'] + '<|turn_end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|role_start|>assistant<|role_end|>' }}{% endif %}",
        '<|role_start|>system<|role_end|>You are a helpful assistant<|turn_end|><|role_start|>user<|role_end|>Hello<|turn_end|><|role_start|>assistant<|role_end|>Hi there<|turn_end|><|role_start|>user<|role_end|>Who are you<|turn_end|><|role_start|>assistant<|role_end|>   I am an assistant   <|turn_end|><|role_start|>user<|role_end|>Another question<|turn_end|><|role_start|>assistant<|role_end|>',
        '', '',
        id='Infinigence/Megrez-3B-Instruct',
    ),
    pytest.param(
        "<s>{%- set names = {'assistant': ' Ассистент:', 'user': ' Пользователь:'} %}\n{%- set tools_prefix = 'Тебе доступны следующие функции:' %}\n{%- macro __render_tool(tool) %}\n    {%- set name = tool.function.name %}\n    {%- set description = tool.function.description|default('') %}\n    {%- set parameters = tool.function.parameters|tojson %}\n    {{- '\\n' }}function {{ '{' }}'name':'{{ name }}',\n    {%- if tool.function.description %}'description':'{{ description }}',{% endif %}\n'parameters':{{ parameters }}\n    {{- '}' }}\n{%- endmacro %}\n{%- macro __render_tools(tools) %}\n    {{- tools_prefix }}\n    {%- for tool in tools %}\n        {{- __render_tool(tool) }}\n    {%- endfor %}\n    {{- '\\n\\n' }}\n{%- endmacro %}\n{%- macro __render_tool_message(message) %}\n    {{- '\\n\\nРезультат вызова' }} {{ message.name }}: {{ message.content }} {{ '\\n\\n' }}\n{%- endmacro %}\n{%- if tools -%}\n    {{- __render_tools(tools) }}\n{%- endif -%}\n{%- macro __render_user_message(message) %}\n{{ names.user }} {{ message.content + '\\n\\n' }}\n{%- endmacro %}\n{%- macro __render_assistant_message(message) %}\n    {{- names.assistant }}\n    {%- set call = message['function_call'] %}\n    {%- if call %}\n        {{- '\\n[TOOL_CALL_START]' }}{{ call.name }}{{ '\\n' }}{{ call.arguments|tojson }}\n    {%- else %}\n        {{- ' ' + message.content + '\\n\\n' }}\n    {%- endif %}\n{%- endmacro %}\n{%- if not add_generation_prompt is defined %}\n{%- set add_generation_prompt = false %}\n{%- endif %}\n{%- for message in messages %}\n    {%- if message['role'] == 'user' %}\n        {{- __render_user_message(message) }}\n    {%- endif %}\n    {%- if message.role == 'assistant' and not loop.last %}\n        {{- __render_assistant_message(message) }}\n    {%- endif %}\n    {%- if message.role == 'tool' %}\n        {{- __render_tool_message(message) }}\n    {%- endif %}\n    {%- if loop.last %}\n        {{- ' Ассистент:[SEP]' }}\n    {%- endif %}\n{%- endfor %}\n",
        '<s> Пользователь: You are a helpful assistant\nHello\n\n Ассистент: Hi there\n\n Пользователь: Who are you\n\n Ассистент:    I am an assistant   \n\n Пользователь: Another question\n\n Ассистент:[SEP]',
        '<s>', '',
        id='yandex/YandexGPT-5-Lite-8B-instruct',
    ),
    pytest.param(
        '{# <seed:bos> #}{%- for message in messages %}{%- if message.role in ["user", "system"] %}{{ bos_token + message.role + "\\n" + message.content + eos_token }}{%- elif message.role == "assistant" %}{{ bos_token + message.role }}{%- if message.content is defined and message.content is string and message.content|trim|length > 0 %}{{ "\\n" + message.content|trim + eos_token }}{%- endif %}{%- else %}{{ bos_token + message.role + "\\n" + message.content + eos_token }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{ bos_token + "assistant\\n" }}{%- endif %}',
        '<seed:bos>system\nYou are a helpful assistant<seed:eos><seed:bos>user\nHello<seed:eos><seed:bos>assistant\nHi there<seed:eos><seed:bos>user\nWho are you<seed:eos><seed:bos>assistant\nI am an assistant<seed:eos><seed:bos>user\nAnother question<seed:eos><seed:bos>assistant\n',
        '<seed:bos>', '<seed:eos>',
        id='ByteDance-Seed/Seed-OSS-36B-Instruct',
    ),
]


def _render(messages, template, bos="", eos="", gen=True, **kw):
    text, used = render_chat(messages, template, bos, eos, gen, **kw)
    return text, used


# ---------------------------------------------------------------------------
# reference outputs from ik_llama.cpp
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("template,expected,bos,eos", LLAMA_CPP_CASES)
def test_llama_cpp_reference_cases(template, expected, bos, eos):
    text, used = _render(CONVERSATION, template, bos, eos)
    assert used == "gguf"
    assert text == expected


# ---------------------------------------------------------------------------
# DeepSeek
# ---------------------------------------------------------------------------
def test_deepseek_v3_conversation():
    head = DS_BOS + "You are a helpful assistant<｜User｜>Hello<｜Assistant｜>Hi there" + DS_EOS + "<｜User｜>Who are you"
    text, used = _render(SHORT, DEEPSEEK_V3, DS_BOS, DS_EOS)
    assert used == "gguf"
    assert text == head + "<｜Assistant｜>"
    text, _ = _render(SHORT, DEEPSEEK_V3, DS_BOS, DS_EOS, gen=False)
    assert text == head


def test_deepseek_v3_long_conversation_keeps_whitespace():
    text, _ = _render(CONVERSATION, DEEPSEEK_V3, DS_BOS, DS_EOS)
    assert text == (
        DS_BOS + "You are a helpful assistant<｜User｜>Hello<｜Assistant｜>Hi there" + DS_EOS
        + "<｜User｜>Who are you<｜Assistant｜>   I am an assistant   " + DS_EOS
        + "<｜User｜>Another question<｜Assistant｜>"
    )


def test_deepseek_v3_two_system_messages_are_joined():
    msgs = [{"role": "system", "content": "A"}, {"role": "system", "content": "B"},
            {"role": "user", "content": "Hi"}]
    text, _ = _render(msgs, DEEPSEEK_V3, DS_BOS, DS_EOS)
    assert text == DS_BOS + "A\n\nB<｜User｜>Hi<｜Assistant｜>"


def test_deepseek_v3_tool_call_round_trip():
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny.", "tool_calls": None},  # null -> dropped
        {"role": "user", "content": "Thanks"},
    ]
    text, _ = _render(msgs, DEEPSEEK_V3, DS_BOS, DS_EOS)
    assert text == (
        DS_BOS + "<｜User｜>Weather in Paris?"
        "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        "```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>" + DS_EOS
        + "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>"
        "<｜tool▁outputs▁end｜>It is sunny." + DS_EOS + "<｜User｜>Thanks<｜Assistant｜>"
    )


def test_deepseek_r1_conversation_strips_reasoning():
    msgs = [dict(m) for m in SHORT]
    msgs[2]["content"] = "<think>The user greets me.</think>Hi there"
    head = DS_BOS + "You are a helpful assistant<｜User｜>Hello<｜Assistant｜>Hi there" + DS_EOS + "<｜User｜>Who are you"
    text, used = _render(msgs, DEEPSEEK_R1, DS_BOS, DS_EOS)
    assert used == "gguf"
    assert text == head + "<｜Assistant｜><think>\n"
    text, _ = _render(msgs, DEEPSEEK_R1, DS_BOS, DS_EOS, gen=False)
    assert text == head


def test_deepseek_v2_conversation():
    head = (DS_BOS + "You are a helpful assistant\n\nUser: Hello\n\nAssistant: Hi there" + DS_EOS
            + "User: Who are you\n\n")
    text, used = _render(SHORT, DEEPSEEK_V2, DS_BOS, DS_EOS)
    assert used == "gguf"
    assert text == head + "Assistant:"
    text, _ = _render(SHORT, DEEPSEEK_V2, DS_BOS, DS_EOS, gen=False)
    assert text == head


# ---------------------------------------------------------------------------
# Llama 3
# ---------------------------------------------------------------------------
L3_BOS = "<|begin_of_text|>"


def _l3(role, content):
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>"


L3_GEN = "<|start_header_id|>assistant<|end_header_id|>\n\n"


def test_llama3_conversation():
    head = (L3_BOS + _l3("system", "You are a helpful assistant") + _l3("user", "Hello")
            + _l3("assistant", "Hi there") + _l3("user", "Who are you"))
    text, used = _render(SHORT, LLAMA3, L3_BOS, "<|eot_id|>")
    assert used == "gguf"
    assert text == head + L3_GEN
    text, _ = _render(SHORT, LLAMA3, L3_BOS, "<|eot_id|>", gen=False)
    assert text == head


def test_llama3_strip_bos():
    text, _ = _render(SHORT, LLAMA3, L3_BOS, "<|eot_id|>", strip_bos=True)
    assert text.startswith("<|start_header_id|>system")
    # nothing to strip when the template does not emit it
    text2, _ = _render(SHORT, QWEN25, L3_BOS, "", strip_bos=True)
    assert text2.startswith("<|im_start|>system")


def test_llama32_uses_strftime_now(monkeypatch):
    monkeypatch.setattr(ct, "_now", lambda: datetime.datetime(2025, 1, 2, 3, 4, 5))
    sys_block = ("<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
                 "Today Date: 02 Jan 2025\n\nYou are a helpful assistant<|eot_id|>")
    head = L3_BOS + sys_block + _l3("user", "Hello") + _l3("assistant", "Hi there") + _l3("user", "Who are you")
    text, _ = _render(SHORT, LLAMA32, L3_BOS, "<|eot_id|>")
    assert text == head + L3_GEN
    text, _ = _render(SHORT, LLAMA32, L3_BOS, "<|eot_id|>", gen=False)
    assert text == head
    # assistant content is trimmed by this template
    text, _ = _render(CONVERSATION, LLAMA32, L3_BOS, "<|eot_id|>")
    assert _l3("assistant", "I am an assistant") in text


def test_extra_vars_reach_the_template():
    text, _ = _render(SHORT, LLAMA32, L3_BOS, "", extra_vars={"date_string": "26 Jul 2024"})
    assert "Today Date: 26 Jul 2024\n\n" in text
    # the standard variables win over extra_vars
    text2, _ = _render(SHORT, LLAMA32, L3_BOS, "",
                       extra_vars={"date_string": "26 Jul 2024", "bos_token": "X", "messages": []})
    assert text2 == text


# ---------------------------------------------------------------------------
# ChatML (Qwen) and the fallback
# ---------------------------------------------------------------------------
CHATML_SHORT = ("<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
                "<|im_start|>user\nHello<|im_end|>\n"
                "<|im_start|>assistant\nHi there<|im_end|>\n"
                "<|im_start|>user\nWho are you<|im_end|>\n")
CHATML_GEN = "<|im_start|>assistant\n"


def test_qwen25_conversation():
    text, used = _render(SHORT, QWEN25, "", "<|im_end|>")
    assert used == "gguf"
    assert text == CHATML_SHORT + CHATML_GEN
    text, _ = _render(SHORT, QWEN25, "", "<|im_end|>", gen=False)
    assert text == CHATML_SHORT


def test_qwen25_default_system_prompt():
    text, _ = _render([{"role": "user", "content": "Hello"}], QWEN25)
    assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                    "<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n" + CHATML_GEN)


def test_qwen25_tools_tojson_keeps_non_ascii_and_does_not_html_escape():
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Météo <ville> & co",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"},
    ]
    text, _ = _render(msgs, QWEN25, extra_vars={"tools": tools})
    assert ('<tools>\n{"type": "function", "function": {"name": "get_weather", '
            '"description": "Météo <ville> & co", "parameters": {"type": "object", '
            '"properties": {"city": {"type": "string"}}}}}\n</tools>') in text
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" + CHATML_GEN)


@pytest.mark.parametrize("template", [None, "", "  \n"])
def test_missing_template_falls_back_to_chatml(template):
    text, used = _render(SHORT, template)
    assert used == "chatml"
    assert text == CHATML_SHORT + CHATML_GEN
    text, used = _render(SHORT, template, gen=False)
    assert used == "chatml"
    assert text == CHATML_SHORT


def test_chatml_fallback_matches_qwen_template():
    for msgs in (SHORT, CONVERSATION):
        for gen in (True, False):
            assert _render(msgs, None, gen=gen)[0] == _render(msgs, QWEN25, gen=gen)[0]


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("template", [
    "{% for message in messages %}{{ message.content }}",     # unclosed block
    "{{ messages[0].content }",                                 # unbalanced braces
    "{% if %}x{% endif %}",                                     # empty condition
    "{% frobnicate %}",                                         # unknown tag
])
def test_broken_template_raises_value_error(template):
    with pytest.raises(ValueError) as info:
        _render(SHORT, template)
    msg = str(info.value)
    assert "chat template" in msg
    assert "\n" not in msg


def test_raise_exception_becomes_value_error():
    tmpl = "{{ raise_exception('Conversation roles must\nalternate!') }}"
    with pytest.raises(ValueError, match="Conversation roles must alternate!") as info:
        _render(SHORT, tmpl)
    assert "\n" not in str(info.value)


def test_reference_template_raise_exception():
    gemma = LLAMA_CPP_CASES[3].values[0]
    assert "raise_exception" in gemma
    # without llama.cpp's polyfill the system message is refused by the template itself
    with pytest.raises(ValueError, match="System role not supported"):
        _render(SHORT, gemma, polyfill=False)
    # roles that do not alternate are refused even with the polyfill
    with pytest.raises(ValueError, match="must alternate"):
        _render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], gemma)


def test_runtime_errors_become_value_error():
    with pytest.raises(ValueError, match="rendering failed"):
        _render(SHORT, "{{ messages[0].content + 1 }}")
    # assistant tool-call turn (content None) through a template that concatenates content
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]
    with pytest.raises(ValueError, match="rendering failed"):
        _render(msgs, DEEPSEEK_V2)


def test_non_string_template_is_rejected():
    with pytest.raises(ValueError, match="must be a string"):
        _render(SHORT, 123)
    with pytest.raises(ValueError, match="must be a dict"):
        _render(SHORT, LLAMA3, extra_vars=["tools"])


def test_sandbox_blocks_mutation_and_internals():
    with pytest.raises(ValueError):
        _render(SHORT, "{% set _ = messages.append(1) %}x")
    with pytest.raises(ValueError):
        _render(SHORT, "{{ cycler.__init__.__globals__.os.system('true') }}")


@pytest.mark.parametrize("messages,fragment", [
    ("hello", "'messages' must be a list"),
    (None, "'messages' must be a list"),
    ([], "at least one message"),
    (["hi"], "messages[0]: expected a message object"),
    ([{"content": "hi"}], "messages[0]: missing 'role'"),
    ([{"role": 1, "content": "hi"}], "'role' must be a string"),
    ([{"role": "", "content": "hi"}], "'role' must not be empty"),
    ([{"role": "user"}], "missing 'content'"),
    ([{"role": "user", "content": None}], "missing 'content'"),
    ([{"role": "user", "content": 5}], "'content' must be a string or a list"),
    ([{"role": "user", "content": {"type": "text", "text": "x"}}], "'content' must be a string or a list"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}], "'image_url'"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "'input_audio'"),
    ([{"role": "user", "content": ["text"]}], "content part object"),
    ([{"role": "user", "content": [{"text": "x"}]}], "missing content part 'type'"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "'text' must be a string"),
    ([{"role": "user", "content": [{"type": "text"}]}], "'text' must be a string"),
    ([{"role": "assistant", "content": None, "tool_calls": {"id": 1}}], "'tool_calls' must be a list"),
    ([{"role": "assistant", "content": None, "tool_calls": []}], "missing 'content'"),
    ([{"role": "user", "content": "ok"}, {"role": "user", "content": 1.5}], "messages[1]"),
])
@pytest.mark.parametrize("template", [None, LLAMA3])
def test_bad_messages_raise_value_error(messages, fragment, template):
    with pytest.raises(ValueError) as info:
        _render(messages, template)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_content_parts_are_joined():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]
    text, _ = _render(msgs, None)
    assert text == "<|im_start|>user\nfirst\nsecond<|im_end|>\n" + CHATML_GEN
    text, _ = _render(msgs, LLAMA3, L3_BOS)
    assert text == L3_BOS + _l3("user", "first\nsecond") + L3_GEN
    text, _ = _render([{"role": "user", "content": []}], None)
    assert text == "<|im_start|>user\n<|im_end|>\n" + CHATML_GEN


def test_input_messages_are_not_modified():
    msgs = [{"role": "developer", "content": [{"type": "text", "text": "a"}]},
            {"role": "user", "content": "b", "name": None}]
    snapshot = [dict(m) for m in msgs]
    _render(msgs, LLAMA3)
    assert msgs == snapshot


# ---------------------------------------------------------------------------
# llama.cpp work-arounds (polyfill)
# ---------------------------------------------------------------------------
def test_developer_role_becomes_system():
    msgs = [{"role": "developer", "content": "Be brief"}, {"role": "user", "content": "Hi"}]
    assert _render(msgs, None)[0].startswith("<|im_start|>system\nBe brief<|im_end|>\n")
    assert _render(msgs, LLAMA3)[0].startswith(_l3("system", "Be brief"))
    # GPT-OSS templates know the developer role
    gpt_oss_like = "{% for m in messages %}<|start|>{{ m.role }}<|channel|>{{ m.content }}{% endfor %}"
    assert _render(msgs, gpt_oss_like, gen=False)[0].startswith("<|start|>developer<|channel|>Be brief")
    # polyfill off: untouched
    assert _render(msgs, None, polyfill=False)[0].startswith("<|im_start|>developer\n")


def test_system_merged_when_template_drops_it():
    phi3_mini = LLAMA_CPP_CASES[8].values[0]
    assert "'system'" not in phi3_mini
    text, _ = _render(SHORT, phi3_mini)
    assert text.startswith("<|user|>\nYou are a helpful assistant\nHello<|end|>\n")
    # without the polyfill the system message is silently lost
    text, _ = _render(SHORT, phi3_mini, polyfill=False)
    assert text.startswith("<|user|>\nHello<|end|>\n")
    # a lone system message is dropped
    text, _ = _render([{"role": "system", "content": "S"}], phi3_mini)
    assert text == ""


def test_system_kept_when_template_supports_it():
    text, _ = _render(SHORT, DEEPSEEK_V3, polyfill=True)
    assert text == _render(SHORT, DEEPSEEK_V3, polyfill=False)[0]


# ---------------------------------------------------------------------------
# environment features (transformers compatibility)
# ---------------------------------------------------------------------------
def test_tojson_filter():
    msgs = [{"role": "user", "content": "héllo <b> & 'q'"}]
    text, _ = _render(msgs, "{{ messages[0].content | tojson }}")
    assert text == '"héllo <b> & \'q\'"'
    text, _ = _render(msgs, "{{ {'b': 1, 'a': [1, 2]} | tojson(indent=2, sort_keys=true) }}")
    assert text == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}'
    text, _ = _render(msgs, "{{ messages[0].content | tojson(ensure_ascii=true) }}")
    assert text == '"h\\u00e9llo <b> & \'q\'"'


def test_loop_controls_and_generation_tag():
    tmpl = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
            "{% generation %}[{{ m.content }}]{% endgeneration %}"
            "{% if loop.index0 >= 2 %}{% break %}{% endif %}{% endfor %}")
    text, _ = _render(CONVERSATION, tmpl, polyfill=False)
    assert text == "[Hello][Hi there]"


def test_trim_blocks_and_lstrip_blocks():
    tmpl = "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}\n"
    text, _ = _render(SHORT, tmpl, polyfill=False)
    assert text == "Hello\nWho are you\n"


def test_strftime_now(monkeypatch):
    monkeypatch.setattr(ct, "_now", lambda: datetime.datetime(2024, 7, 26, 12, 0, 0))
    text, _ = _render(SHORT, "{{ strftime_now('%Y-%m-%d %H:%M') }}")
    assert text == "2024-07-26 12:00"


def test_add_generation_prompt_and_tokens_are_visible():
    tmpl = "{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ messages | length }}"
    assert _render(SHORT, tmpl, "<s>", "</s>", polyfill=False)[0] == "<s>|</s>|True|4"
    assert _render(SHORT, tmpl, "<s>", "</s>", gen=False, polyfill=False)[0] == "<s>|</s>|False|4"
    # with the polyfill, a template that never shows the system message gets it merged
    # into the first user message (as llama.cpp does): one message less
    assert _render(SHORT, tmpl, "<s>", "</s>")[0] == "<s>|</s>|True|3"


# ---------------------------------------------------------------------------
# built-in formats (`--chat-template NAME`, ik's hard-coded formatter)
# ---------------------------------------------------------------------------
# ik_llama.cpp's tests/test-chat-template.cpp `expected_output` values (the 6-message
# CONVERSATION through its built-in formatter), keyed by the built-in each case's template
# is detected as.  Left out: ChatGLM4 and granite, whose goldens there lack the trailing
# "\n" that ik's formatter now writes after the generation prompt (stale in ik's test).
IK_LEGACY_EXPECTED = {
    'chatml': "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nWho are you<|im_end|>\n<|im_start|>assistant\n   I am an assistant   <|im_end|>\n<|im_start|>user\nAnother question<|im_end|>\n<|im_start|>assistant\n",
    'llama2': "[INST] You are a helpful assistant\nHello [/INST]Hi there</s>[INST] Who are you [/INST]   I am an assistant   </s>[INST] Another question [/INST]",
    'llama2-sys-bos': "[INST] <<SYS>>\nYou are a helpful assistant\n<</SYS>>\n\nHello [/INST]Hi there</s><s>[INST] Who are you [/INST]   I am an assistant   </s><s>[INST] Another question [/INST]",
    'llama2-sys-strip': "[INST] <<SYS>>\nYou are a helpful assistant\n<</SYS>>\n\nHello [/INST]Hi there</s>[INST] Who are you [/INST]I am an assistant</s>[INST] Another question [/INST]",
    'monarch': "system\nYou are a helpful assistant</s>\n<s>user\nHello</s>\n<s>assistant\nHi there</s>\n<s>user\nWho are you</s>\n<s>assistant\n   I am an assistant   </s>\n<s>user\nAnother question</s>\n<s>assistant\n",
    'gemma': "<start_of_turn>user\nYou are a helpful assistant\n\nHello<end_of_turn>\n<start_of_turn>model\nHi there<end_of_turn>\n<start_of_turn>user\nWho are you<end_of_turn>\n<start_of_turn>model\nI am an assistant<end_of_turn>\n<start_of_turn>user\nAnother question<end_of_turn>\n<start_of_turn>model\n",
    'orion': "Human: You are a helpful assistant\n\nHello\n\nAssistant: </s>Hi there</s>Human: Who are you\n\nAssistant: </s>   I am an assistant   </s>Human: Another question\n\nAssistant: </s>",
    'openchat': "You are a helpful assistant<|end_of_turn|>GPT4 Correct User: Hello<|end_of_turn|>GPT4 Correct Assistant: Hi there<|end_of_turn|>GPT4 Correct User: Who are you<|end_of_turn|>GPT4 Correct Assistant:    I am an assistant   <|end_of_turn|>GPT4 Correct User: Another question<|end_of_turn|>GPT4 Correct Assistant:",
    'deepseek': "You are a helpful assistant### Instruction:\nHello\n### Response:\nHi there\n<|EOT|>\n### Instruction:\nWho are you\n### Response:\n   I am an assistant   \n<|EOT|>\n### Instruction:\nAnother question\n### Response:\n",
    'vicuna': "You are a helpful assistant\n\nUSER: Hello\nASSISTANT: Hi there</s>\nUSER: Who are you\nASSISTANT:    I am an assistant   </s>\nUSER: Another question\nASSISTANT:",
    'vicuna-orca': "SYSTEM: You are a helpful assistant\nUSER: Hello\nASSISTANT: Hi there</s>\nUSER: Who are you\nASSISTANT:    I am an assistant   </s>\nUSER: Another question\nASSISTANT:",
    'command-r': "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a helpful assistant<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hello<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Who are you<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>I am an assistant<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Another question<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    'llama3': "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWho are you<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nI am an assistant<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nAnother question<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    'phi3': "<|system|>\nYou are a helpful assistant<|end|>\n<|user|>\nHello<|end|>\n<|assistant|>\nHi there<|end|>\n<|user|>\nWho are you<|end|>\n<|assistant|>\n   I am an assistant   <|end|>\n<|user|>\nAnother question<|end|>\n<|assistant|>\n",
    'chatglm3': "[gMASK]sop<|system|>\n You are a helpful assistant<|user|>\n Hello<|assistant|>\n Hi there<|user|>\n Who are you<|assistant|>\n    I am an assistant   <|user|>\n Another question<|assistant|>",
    'minicpm': "You are a helpful assistant<用户>Hello<AI>Hi there<用户>Who are you<AI>I am an assistant<用户>Another question<AI>",
    'deepseek2': "You are a helpful assistant\n\nUser: Hello\n\nAssistant: Hi there<｜end▁of▁sentence｜>User: Who are you\n\nAssistant:    I am an assistant   <｜end▁of▁sentence｜>User: Another question\n\nAssistant:",
    'mistral-v1': " [INST] You are a helpful assistant\n\nHello [/INST] Hi there</s> [INST] Who are you [/INST]    I am an assistant   </s> [INST] Another question [/INST]",
    'mistral-v3': "[INST] You are a helpful assistant\n\nHello[/INST] Hi there</s>[INST] Who are you[/INST] I am an assistant</s>[INST] Another question[/INST]",
    'mistral-v3-tekken': "[INST]You are a helpful assistant\n\nHello[/INST]Hi there</s>[INST]Who are you[/INST]   I am an assistant   </s>[INST]Another question[/INST]",
    'mistral-v7': "[SYSTEM_PROMPT] You are a helpful assistant[/SYSTEM_PROMPT][INST] Hello[/INST] Hi there</s>[INST] Who are you[/INST]    I am an assistant   </s>[INST] Another question[/INST]",
    'gigachat': "<s>You are a helpful assistant<|message_sep|>user<|role_sep|>Hello<|message_sep|>available functions<|role_sep|>[]<|message_sep|>assistant<|role_sep|>Hi there<|message_sep|>user<|role_sep|>Who are you<|message_sep|>available functions<|role_sep|>[]<|message_sep|>assistant<|role_sep|>   I am an assistant   <|message_sep|>user<|role_sep|>Another question<|message_sep|>available functions<|role_sep|>[]<|message_sep|>assistant<|role_sep|>",
    'megrez': "<|role_start|>system<|role_end|>You are a helpful assistant<|turn_end|><|role_start|>user<|role_end|>Hello<|turn_end|><|role_start|>assistant<|role_end|>Hi there<|turn_end|><|role_start|>user<|role_end|>Who are you<|turn_end|><|role_start|>assistant<|role_end|>   I am an assistant   <|turn_end|><|role_start|>user<|role_end|>Another question<|turn_end|><|role_start|>assistant<|role_end|>",
    'bailing': "<role>SYSTEM</role>You are a helpful assistant<role>HUMAN</role>Hello<role>ASSISTANT</role>Hi there<role>HUMAN</role>Who are you<role>ASSISTANT</role>   I am an assistant   <role>HUMAN</role>Another question<role>ASSISTANT</role>",
    'seed_oss': "<seed:bos>system\nYou are a helpful assistant<seed:eos><seed:bos>user\nHello<seed:eos><seed:bos>assistant\nHi there<seed:eos><seed:bos>user\nWho are you<seed:eos><seed:bos>assistant\nI am an assistant<seed:eos><seed:bos>user\nAnother question<seed:eos><seed:bos>assistant\n",
}

SHARED_TEMPLATES = pathlib.Path("/work/shared/templates")
_needs_shared = pytest.mark.skipif(not SHARED_TEMPLATES.is_dir(), reason="no /work/shared/templates")


def _shared(name: str) -> str:
    return (SHARED_TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", sorted(IK_LEGACY_EXPECTED))
def test_builtin_matches_ik_goldens(name):
    assert ct.render_builtin(name, CONVERSATION) == IK_LEGACY_EXPECTED[name]


def test_builtin_names_cover_ik_table():
    names = ct.builtin_template_names()
    for required in ("chatml", "llama2", "llama2-sys", "mistral-v1", "mistral-v3", "mistral-v7", "llama3", "phi3",
                     "zephyr", "gemma", "deepseek", "deepseek2", "deepseek3", "command-r", "vicuna", "openchat",
                     "chatglm4", "kimi-k2", "gpt-oss"):
        assert required in names
    assert len(names) == 43 and names == sorted(names)   # all of ik's LLM_CHAT_TEMPLATES
    assert ct.render_builtin("deepseek4", SHORT) == ct.render_builtin("deepseek3", SHORT)


def test_builtin_generation_prompt_flag():
    with_gen = ct.render_builtin("llama3", SHORT, True)
    without = ct.render_builtin("llama3", SHORT, False)
    assert with_gen == without + "<|start_header_id|>assistant<|end_header_id|>\n\n"
    # the mistral formats never add one (the open [INST] turn is the prompt)
    assert ct.render_builtin("mistral-v7", SHORT, True) == ct.render_builtin("mistral-v7", SHORT, False)


def test_builtin_trims_ascii_whitespace_only():
    msgs = [{"role": "user", "content": "\u00a0 hi \t\n"}]
    assert ct.render_builtin("llama3", msgs, False) == "<|start_header_id|>user<|end_header_id|>\n\n\u00a0 hi<|eot_id|>"


def test_builtin_content_parts_and_unknown_roles():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "tool", "content": "t"}]
    # deepseek has no case for other roles: the tool message is left out, as in ik
    assert ct.render_builtin("deepseek", msgs) == "### Instruction:\na\nb\n### Response:\n"
    assert ct.render_builtin("chatml", msgs, False) == "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>tool\nt<|im_end|>\n"


def test_unknown_builtin_name_lists_valid_names():
    with pytest.raises(ValueError) as e:
        ct.render_builtin("llama-9", SHORT)
    msg = str(e.value)
    assert "unknown built-in chat template 'llama-9'" in msg and "chatml" in msg and "gpt-oss" in msg
    with pytest.raises(ValueError, match="valid names"):
        ct.builtin_renderer("nope")


def test_builtin_renderer_is_a_render_chat_drop_in():
    render = ct.builtin_renderer("phi3")
    prompt, used = render(SHORT, "{{ ignored }}", "<s>", "</s>", True, extra_vars={"x": 1})
    assert used == "phi3"
    assert prompt == ct.render_builtin("phi3", SHORT)
    with pytest.raises(ValueError, match="messages"):
        render([], None)


# --- against the real Jinja templates (render_chat) ------------------------------------------
@_needs_shared
def test_builtin_chatml_equals_qwen25_template():
    assert ct.render_builtin("chatml", SHORT) == render_chat(SHORT, _shared("Qwen-Qwen2.5-7B-Instruct"))[0]


@_needs_shared
def test_builtin_llama3_vs_llama33_template(monkeypatch):
    # documented difference: the Jinja template writes BOS and the date header into the system turn
    monkeypatch.setattr(ct, "_now", lambda: datetime.datetime(2024, 7, 26))
    jinja = render_chat(SHORT, _shared("meta-llama-Llama-3.3-70B-Instruct"), "<|begin_of_text|>")[0]
    builtin = ct.render_builtin("llama3", SHORT)
    header = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
    assert jinja == "<|begin_of_text|>" + builtin.replace("\n\nYou are", "\n\n" + header + "You are", 1)


@_needs_shared
def test_builtin_gemma_vs_gemma2_template():
    template = _shared("google-gemma-2-2b-it")
    # without a system message: equal but for the BOS the template writes
    assert render_chat(SHORT[1:], template, "<bos>")[0] == "<bos>" + ct.render_builtin("gemma", SHORT[1:])
    # with one: ik's builtin joins it to the user text with "\n\n", the --jinja polyfill with "\n"
    jinja = render_chat(SHORT, template, "<bos>")[0]
    builtin = ct.render_builtin("gemma", SHORT)
    assert jinja == "<bos>" + builtin.replace("assistant\n\nHello", "assistant\nHello")


@_needs_shared
def test_builtin_deepseek3_vs_deepseek_v3_templates():
    # documented difference: the templates write BOS and join the system text without "\n\n";
    # V3.1 (thinking off) also opens each assistant turn with an empty think block
    builtin = ct.render_builtin("deepseek3", SHORT)
    plain = builtin.replace("assistant\n\n", "assistant", 1)
    assert render_chat(SHORT, DEEPSEEK_V3, DS_BOS, DS_EOS)[0] == DS_BOS + plain
    v31 = render_chat(SHORT, _shared("deepseek-ai-DeepSeek-V3.1"), DS_BOS, DS_EOS)[0]
    assert v31 == DS_BOS + plain.replace("<｜Assistant｜>", "<｜Assistant｜><think></think>")


@_needs_shared
def test_builtin_mistral_v3_tekken_vs_mistral_nemo_template():
    # ik detects Mistral-Nemo's template as mistral-v3-tekken; the template writes BOS and puts the
    # system message in front of the LAST user message, the builtin in front of the first
    template = _shared("mistralai-Mistral-Nemo-Instruct-2407")
    assert render_chat(SHORT[1:], template, "<s>", "</s>")[0] == "<s>" + ct.render_builtin("mistral-v3-tekken", SHORT[1:])
    moved = [SHORT[1], SHORT[2], SHORT[0], SHORT[3]]
    assert render_chat(SHORT, template, "<s>", "</s>")[0] == "<s>" + ct.render_builtin("mistral-v3-tekken", moved)


@_needs_shared
def test_builtin_kimi_k2_vs_kimi_template():
    # ik's kimi-k2 formatter swaps the user/assistant turn labels (sic, kept for equal prompts);
    # with the labels swapped back it equals the real template
    builtin = ct.render_builtin("kimi-k2", SHORT, False)
    user, asst = "<|im_user|>user<|im_middle|>", "<|im_assistant|>assistant<|im_middle|>"
    fixed = builtin.replace(user, "\0").replace(asst, user).replace("\0", asst)
    assert render_chat(SHORT, _shared("Kimi-K2-Instruct"), add_generation_prompt=False)[0] == fixed
    assert ct.render_builtin("kimi-k2", SHORT).endswith(asst)
    assert render_chat(SHORT, _shared("Kimi-K2-Instruct"))[0].endswith(asst)


@_needs_shared
def test_builtin_gpt_oss_vs_harmony_template(monkeypatch):
    # documented difference: the builtin is a bare Harmony layout (no model-identity system preamble,
    # system text not moved to a developer message, no channel, <|return|> after assistant turns)
    monkeypatch.setattr(ct, "_now", lambda: datetime.datetime(2024, 7, 26))
    jinja = render_chat(SHORT, _shared("openai-gpt-oss-120b"))[0]
    builtin = ct.render_builtin("gpt-oss", SHORT)
    tail = "<|start|>user<|message|>Who are you<|end|><|start|>assistant"
    assert jinja.endswith(tail) and builtin.endswith(tail)
    assert "<|start|>assistant<|channel|>final<|message|>Hi there<|end|>" in jinja
    assert "<|start|>assistant<|message|>Hi there<|return|>" in builtin
    assert builtin.startswith("<|start|>system<|message|>You are a helpful assistant<|end|>")
