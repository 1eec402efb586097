// Inputs for make_references.js: the conversations every real template is
// rendered with, and constructed templates that exercise one construct each.
"use strict";

const tools = [
  {
    type: "function",
    function: {
      name: "get_weather",
      description: "Get the current weather in a city",
      parameters: {
        type: "object",
        properties: { city: { type: "string", description: "The city, e.g. Paris" }, unit: { type: "string", enum: ["celsius", "fahrenheit"] } },
        required: ["city"],
      },
    },
  },
  { type: "function", function: { name: "add", description: "Add two numbers", parameters: { type: "object", properties: { a: { type: "number" }, b: { type: "number" } } } } },
];

const conversations = {
  single_user: [{ role: "user", content: "Hello!" }],
  system_user: [{ role: "system", content: "You are a helpful assistant." }, { role: "user", content: "What is 2+2?" }],
  multi_turn: [
    { role: "user", content: "Hi" },
    { role: "assistant", content: "Hello! How can I help?" },
    { role: "user", content: "Tell me a joke." },
  ],
  system_multi_turn_ends_assistant: [
    { role: "system", content: "Be brief." },
    { role: "user", content: "Capital of France?" },
    { role: "assistant", content: "Paris." },
  ],
  long: [
    { role: "system", content: "  You are a pirate.  " },
    { role: "user", content: "one" }, { role: "assistant", content: "two" },
    { role: "user", content: "three" }, { role: "assistant", content: "four" },
    { role: "user", content: "five" }, { role: "assistant", content: "six" },
    { role: "user", content: "seven" },
  ],
  not_alternating: [{ role: "user", content: "a" }, { role: "user", content: "b" }],
  empty_content: [{ role: "user", content: "" }, { role: "assistant", content: "" }, { role: "user", content: "?" }],
  unicode: [
    { role: "system", content: "Réponds en français 🇫🇷" },
    { role: "user", content: "你好，世界！😀 Ünïcödé — \u00a0nbsp" },
    { role: "assistant", content: "こんにちは 👋🏽" },
    { role: "user", content: "Ω≈ç√∫ 🚀🚀" },
  ],
  jinja_looking: [
    { role: "user", content: "Render {{ messages }} and {% if true %}x{% endif %} {# c #}" },
    { role: "assistant", content: "{%- raw -%} '\"quotes\"' \\ backslash \\n" },
    { role: "user", content: "<|im_end|> <s> [INST] </s>" },
  ],
  whitespace: [{ role: "user", content: "\n\n  padded text \t\n" }, { role: "assistant", content: "  answer\n\n" }, { role: "user", content: " \n" }],
  tool_calls: [
    { role: "system", content: "You can call tools." },
    { role: "user", content: "Weather in Paris?" },
    { role: "assistant", content: "", tool_calls: [{ type: "function", function: { name: "get_weather", arguments: { city: "Paris", unit: "celsius" } } }] },
    { role: "tool", name: "get_weather", content: "{\"temperature\": 21.5, \"sky\": \"clear\"}" },
  ],
  tool_calls_no_system: [
    { role: "user", content: "Add 2 and 3" },
    { role: "assistant", content: "Let me add.", tool_calls: [{ type: "function", function: { name: "add", arguments: { a: 2, b: 3.5 } } }] },
    { role: "tool", content: "5.5" },
    { role: "assistant", content: "It is 5.5." },
    { role: "user", content: "Thanks" },
  ],
  reasoning: [
    { role: "user", content: "Think about it" },
    { role: "assistant", content: "<think>\nLet me think.\n</think>\n\nThe answer is 42." },
    { role: "user", content: "Again" },
  ],
  reasoning_content: [
    { role: "user", content: "Why?" },
    { role: "assistant", content: "Because.", reasoning_content: "\nI considered it.\n" },
    { role: "user", content: "Ok" },
  ],
  empty: [],
};

const chatContexts = [];
for (const [name, messages] of Object.entries(conversations)) {
  for (const add_generation_prompt of [false, true]) {
    chatContexts.push({ messages, add_generation_prompt, bos_token: "<s>", eos_token: "</s>" });
  }
  if (name.startsWith("tool") || name === "system_user" || name === "single_user") {
    chatContexts.push({ messages, add_generation_prompt: true, bos_token: "<|begin_of_text|>", eos_token: "<|eot_id|>", tools });
    chatContexts.push({ messages, add_generation_prompt: true, bos_token: "<s>", eos_token: "</s>", tools, tools_in_user_message: false, date_string: "01 Jan 2025" });
  }
}
chatContexts.push({ messages: conversations.multi_turn, bos_token: "<bos>", eos_token: "<eos>" });
chatContexts.push({ messages: conversations.system_user, add_generation_prompt: true, bos_token: "", eos_token: "", enable_thinking: false });
chatContexts.push({ messages: conversations.multi_turn, add_generation_prompt: true, USE_DEFAULT_PROMPT: true, bos_token: "<s>", eos_token: "</s>" });

const data = {
  messages: conversations.tool_calls,
  names: ["b", "A", "c", "a"],
  nums: [3, 1.5, -2, 10, 0],
  words: "  Hello World, foo-bar baz_qux  ",
  obj: { z: 1, a: "two", m: [1, 2, { x: null }], t: true, f: 2.5, n: null },
  users: [{ name: "Ann", age: 31, active: true, role: "admin" }, { name: "bob", age: 25, active: false, role: "user" }, { name: "Cy", age: 40, role: "user" }],
  s: "a,b,,c",
  e: "",
  i: 7,
  f: 2.0,
  g: 0.1,
  big: 123456789012,
  t: true,
  nil: null,
  emoji: "héllo 😀 世界",
};

// [name, template, contexts (default: [data])]
const cases = [
  ["text_only", "plain text\nwith lines\n"],
  ["trailing_newlines", "a\n\n"],
  ["print_values", "{{ i }}|{{ f }}|{{ g }}|{{ big }}|{{ t }}|{{ nil }}|{{ undefined_var }}|{{ names }}|{{ obj }}|{{ 1.0 }}|{{ -0.0 }}|{{ 3.14 }}|{{ 100000000000000000000.0 }}|{{ 1.5 * 1000000 }}"],
  ["arith", "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 6 / 3 }} {{ 2 ** 10 }} {{ 2 ** -1 }} {{ 2.5 * 2 }} {{ 1 + 2 * 3 - 4 }} {{ (1 + 2) * 3 }} {{ 0.1 + 0.2 }} {{ 0.000001 }} {{ 0.0000001 }} {{ 123456789.125 }} {{ 10 - 2.5 }}"],
  ["concat_tilde", "{{ 'a' ~ 1 ~ 1.0 ~ 2.5 ~ true ~ names }}|{{ 'x' + 1 }}|{{ 1.0 ~ '' }}|{{ [1, 2] + [3] }}"],
  ["compare", "{{ 1 == 1.0 }} {{ 1 == '1' }} {{ 'a' == 'a' }} {{ 1 != 2 }} {{ 2 > 1 }} {{ 1 <= 1 }} {{ none == none }} {{ nil is none }} {{ undefined_var == none }} {{ names == names }} {{ [1] == [1] }} {{ true == 1 }}"],
  ["logic", "{{ true and 'x' }}|{{ false or 'y' }}|{{ not 0 }}|{{ [] or 'empty' }}|{{ {} or 'e' }}|{{ 'a' if t else 'b' }}|{{ 'a' if nil }}|{{ not not 1 }}|{{ e or 'default' }}"],
  ["membership", "{{ 'a' in 'cat' }} {{ 'A' in names }} {{ 3 in [1, 2, 3] }} {{ 3.0 in [3] }} {{ 'z' in obj }} {{ 'q' not in obj }} {{ 'x' in undefined_var }} {{ 'x' not in undefined_var }} {{ 1 not in nums }}"],
  ["tests", "{% for v in [1, 1.5, 'a', true, none, [1], {'k': 1}, undefined_var] %}[{{ v is defined }}{{ v is undefined }}{{ v is none }}{{ v is string }}{{ v is number }}{{ v is integer }}{{ v is boolean }}{{ v is mapping }}{{ v is iterable }}{{ v is sequence }}{{ v is true }}{{ v is false }}{{ v is callable }}]{% endfor %}{{ 3 is odd }}{{ 4 is even }}{{ 'abc' is lower }}{{ 'ABC' is upper }}{{ 'aB' is not lower }}{{ range is callable }}"],
  ["filters_strings", "{{ words | trim }}|{{ words | upper }}|{{ words | lower }}|{{ words | title }}|{{ 'hELLO wORLD' | capitalize }}|{{ words | length }}|{{ emoji | length }}|{{ 'x' | string }}|{{ ' 42abc' | int }}|{{ '3.5e2x' | float }}|{{ 'abc' | int }}|{{ 'abc' | int(7) }}|{{ 'abc' | float(1.5) }}|{{ 'a-b' | replace('-', '+') }}|{{ 'aaa' | replace('a', 'b', 2) }}|{{ 'ab' | replace('', '.') }}"],
  ["filters_lists", "{{ names | first }}|{{ names | last }}|{{ names | length }}|{{ names | reverse }}|{{ names | sort }}|{{ names | sort(reverse=true) }}|{{ names | sort(case_sensitive=true) }}|{{ names | join }}|{{ names | join(', ') }}|{{ nums | sort }}|{{ [1, 1, 2, 1.0, 'a', 'a'] | unique }}|{{ names | list }}|{{ names | string }}|{{ 'abc' | join('-') }}"],
  ["filters_numbers", "{{ -3 | abs }}|{{ -2.5 | abs }}|{{ 2.7 | int }}|{{ -2.7 | int }}|{{ 3 | float }}|{{ 2.5 | string }}|{{ 2 | string }}|{{ true | int }}|{{ false | float }}|{{ true | string }}|{{ 3.7 | int(0) }}"],
  ["filters_dicts", "{% for k, v in obj | items %}{{ k }}={{ v }};{% endfor %}|{{ obj | length }}|{{ obj | dictsort }}|{{ obj.keys() }}|{{ obj.values() | length }}|{{ obj.get('a') }}|{{ obj.get('missing') }}|{{ obj.get('missing', 'dflt') }}|{{ obj | dictsort(reverse=true) | first }}|{{ users[0] | dictsort(by='key') }}"],
  ["default_filter", "{{ undefined_var | default('d') }}|{{ e | default('d') }}|{{ e | default('d', true) }}|{{ nil | default('d') }}|{{ nil | default('d', boolean=true) }}|{{ i | default(0) }}"],
  ["error_bare_default", "{{ undefined_var | default }}"],
  ["tojson", "{{ obj | tojson }}|{{ names | tojson(indent=2) }}|{{ obj | tojson(indent=4) }}|{{ emoji | tojson }}|{{ emoji | tojson(ensure_ascii=true) }}|{{ obj | tojson(sort_keys=true) }}|{{ users | tojson(separators=(',', ':')) }}|{{ 'a\"b\\\\c\\n\\t' | tojson }}|{{ [] | tojson(indent=2) }}|{{ {} | tojson(indent=2) }}|{{ undefined_var | tojson }}|{{ f | tojson }}|{{ g | tojson }}|{{ nil | tojson }}"],
  ["selectattr", "{{ users | selectattr('active') | map(attribute='name') | join(',') }}|{{ users | rejectattr('active') | map(attribute='name') | list }}|{{ users | selectattr('role', 'equalto', 'user') | length }}|{{ users | selectattr('role', 'eq', 'admin') | first }}|{{ users | map(attribute='age') | sort | first }}|{{ users | map(attribute='missing', default='?') | join }}|{{ users | sort(attribute='age') | map(attribute='name') | join }}|{{ users | selectattr('active', 'defined') | length }}"],
  ["map_dotted", "{{ messages | map(attribute='role') | join(' ') }}|{{ messages | selectattr('tool_calls', 'defined') | map(attribute='tool_calls.0.function.name') | join }}"],
  ["indent_filter", "{{ 'a\\nb\\n\\nc' | indent }}|{{ 'a\\nb\\n\\nc' | indent(2) }}|{{ 'a\\nb\\n\\nc' | indent(2, true) }}|{{ 'a\\nb\\n\\nc' | indent(width=3, first=true, blank=true) }}"],
  ["string_methods", "{{ words.strip() }}|{{ words.lstrip() }}|{{ words.rstrip() }}|{{ 'xxhixx'.strip('x') }}|{{ words.upper() }}|{{ words.lower() }}|{{ 'hello world'.title() }}|{{ 'hello'.capitalize() }}|{{ 'abc'.startswith('ab') }}|{{ 'abc'.endswith(('x', 'c')) }}|{{ s.split(',') }}|{{ s.split(',', 1) }}|{{ '  a  b c '.split() }}|{{ ' a b c'.split(none, 1) }}|{{ 'a-b-c'.replace('-', '') }}|{{ 'aaaa'.replace('a', 'b', count=2) }}|{{ words.length }}|{{ names.length }}"],
  ["subscripts_slices", "{{ names[0] }}{{ names[-1] }}{{ names[1:3] }}{{ names[::-1] }}{{ names[::2] }}{{ names[-2:] }}{{ names[:-1] }}{{ names[5] }}|{{ 'hello'[1:4] }}{{ 'hello'[::-1] }}{{ 'hello'[-1] }}{{ 'hello'[10] }}{{ emoji[::-1] }}{{ emoji[0:3] }}|{{ obj['a'] }}{{ obj.a }}{{ obj.missing }}{{ obj.m[2].x }}{{ users.0.name }}{{ names[3:0:-1] }}{{ nums[1::-1] }}"],
  ["loop_vars", "{% for n in names %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.previtem }}{{ loop.nextitem }};{% endfor %}"],
  ["loop_filter_else", "{% for n in nums if n > 0 %}{{ n }}({{ loop.index }}/{{ loop.length }}) {% else %}none{% endfor %}|{% for x in [] %}x{% else %}empty{% endfor %}|{% for x in nums if x > 100 %}x{% else %}no big{% endfor %}"],
  ["loop_break_continue", "{% for n in range(10) %}{% if n is odd %}{% continue %}{% endif %}{% if n > 6 %}{% break %}{% endif %}{{ n }}{% endfor %}"],
  ["loop_dict_and_unpack", "{% for k in obj %}{{ k }},{% endfor %}|{% for k, v in obj.items() %}{{ k }}:{{ v }} {% endfor %}|{% for a, b in [[1, 2], [3, 4]] %}{{ a + b }}{% endfor %}"],
  ["nested_loops", "{% for u in users %}{% for k, v in u | items %}{% if not loop.first %},{% endif %}{{ k }}{% endfor %}{% if not loop.last %};{% endif %}{% endfor %}"],
  ["range", "{{ range(5) }}{{ range(2, 5) }}{{ range(10, 0, -3) }}{{ range(0) }}{% for i in range(3) %}{{ i }}{% endfor %}"],
  ["set_and_scope", "{% set x = 1 %}{% for n in names %}{% set x = x + 1 %}{% endfor %}{{ x }}|{% set a, b = 1, 2 %}{{ a }}{{ b }}|{% set t = (1, 2) %}{{ t | length }}{{ t[0] }}|{% if true %}{% set y = 5 %}{% endif %}{{ y }}"],
  ["namespace", "{% set ns = namespace(count=0, found=false, items=[]) %}{% for n in nums %}{% if n > 0 %}{% set ns.count = ns.count + 1 %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.count }} {{ ns.found }} {{ ns.missing }}|{% set ns2 = namespace({'a': 1}, b=2) %}{{ ns2.a }}{{ ns2.b }}|{{ ns }}"],
  ["block_set", "{% set body %}Hello {{ names | join(' and ') }}!{% endset %}[{{ body }}]{{ body | length }}"],
  ["macros", "{% macro greet(name, greeting='Hello', punct='!') %}{{ greeting }}, {{ name }}{{ punct }}{% endmacro %}{{ greet('Ann') }}|{{ greet('Bob', 'Hi') }}|{{ greet('Cy', punct='?') }}|{% macro rec(n) %}{% if n > 0 %}{{ n }}{{ rec(n - 1) }}{% endif %}{% endmacro %}{{ rec(5) }}|{% macro va(a) %}{{ a }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ va(1, 2, 3, k=4) }}"],
  ["call_block", "{% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}{% call wrap('b') %}bold {{ i }}{% endcall %}|{% macro each(xs) %}{% for x in xs %}{{ caller(x) }}{% endfor %}{% endmacro %}{% call(x) each(names) %}[{{ x }}]{% endcall %}"],
  ["filter_block", "{% filter upper %}hello {{ names[0] }}{% endfilter %}|{% filter trim %}   spaced   {% endfilter %}|{% filter replace('a', 'o') %}banana{% endfilter %}"],
  ["whitespace_control", "a  {{- ' b ' -}}  c\n  {%- if true -%}  d  {%- endif -%}  e {#- comment -#} f\n{# plain comment #}g"],
  ["lstrip_trim_blocks", "line1\n    {% if true %}\n    inside\n    {% endif %}\nline2\n  {# c #}\nline3\n{% for x in [1,2] %}\n  item {{ x }}\n{% endfor %}\nend\n"],
  ["generation_tags", "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}[A]{% endgeneration %}{% else %}{{ m.role }}:{{ m.content | length }}\n{% endif %}{% endfor %}\n  {%- generation -%}  x  {%- endgeneration -%}  \ny"],
  ["literals", "{{ 'single' }}{{ \"double\" }}{{ 'esc\\'aped\\\\n' }}{{ 'tab\\tnew\\nline' }}{{ 'uni\\u00e9\\x41' }}{{ [1, 'two', [3], {'four': 4}] }}{{ {'a': 1, 'b': [true, false, none]} }}{{ 'con' 'cat' }}{{ True }}{{ False }}{{ None }}"],
  ["ternary_chain", "{% for n in [0, 1, 2, 3] %}{{ 'zero' if n == 0 else 'one' if n == 1 else 'many' }} {% endfor %}"],
  ["unary_and_precedence", "{{ -i }}{{ +i }}{{ -(-i) }}{{ - 2 ** 2 }}{{ -2.5 }}{{ not true and false }}{{ 1 + 2 ~ 3 }}{{ 2 * 3 ** 2 }}{{ 10 - 3 - 2 }}{{ 2 ** 3 ** 2 }}"],
  ["error_is_binds_tighter", "{{ i + 1 is odd }}"],
  ["is_precedence", "{{ 'a' ~ nil is none }}|{{ names | length is integer }}"],
  ["raise_exception", "{% if messages | length > 1 %}{{ raise_exception('Too many messages: ' ~ messages | length) }}{% endif %}ok"],
  ["member_on_undefined", "{{ foo.bar }}|{{ foo['x'] }}|{{ foo.bar is defined }}|{{ nil.x }}|{{ i.x }}"],
  ["error_undefined_arith", "{{ undefined_var + 1 }}"],
  ["error_none_concat", "{{ 'a' ~ nil }}"],
  ["error_unknown_method", "{{ names.append(1) }}"],
  ["error_call_non_function", "{{ i() }}"],
  ["error_for_over_string", "{% for c in 'abc' %}{{ c }}{% endfor %}"],
  ["error_string_compare", "{{ 'a' < 'b' }}"],
  ["error_filter_type", "{{ i | upper }}"],
  ["error_unclosed_if", "{% if true %}x"],
  ["error_unknown_tag", "{% frobnicate %}"],
  ["error_set_attr_on_dict", "{% set obj.x = 1 %}"],
  ["error_unpack_count", "{% for a, b in [[1, 2, 3]] %}{% endfor %}"],
  ["error_bad_expression", "{{ 1 + }}"],
  ["error_unterminated_string", "{{ 'abc }}"],
  ["error_map_without_attribute", "{{ names | map('upper') | list }}"],
  ["error_macro_too_many_args", "{% macro m(a) %}{{ a }}{% endmacro %}{{ m(1, 2) }}"],
  ["error_print_tuple", "{{ (1, 2) }}"],
  ["strftime_defined", "{{ strftime_now is defined }}{{ raise_exception is callable }}"],
  ["chatml_custom", "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}{%- if message.content is string %}{{- message.content }}{%- endif %}{%- if message.tool_calls %}{%- for tc in message.tool_calls %}\n<tool_call>\n{{- tc.function | tojson }}\n</tool_call>{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    [{ messages: conversations.tool_calls, add_generation_prompt: true }, { messages: conversations.unicode, add_generation_prompt: false }, { messages: conversations.jinja_looking }]],
];

const templates = {};
const contexts = {};
for (const [name, source, ctx] of cases) {
  templates[name] = source;
  contexts[name] = ctx ?? [data];
}

module.exports = {
  chatContexts,
  templates,
  contextsFor: (name) => contexts[name],
};
