"""A small English and Korean corpus that the synthetic byte-level BPE tokenizer is trained on.

It is kept in a module rather than a data file so that it ships with the package without any
package-data configuration. The text only has to give the BPE trainer common English and Korean
byte pairs to merge; nothing depends on its meaning.
"""

from __future__ import annotations

ENGLISH = """\
The morning train to the coast leaves at a quarter past seven. Most people on it are going to work,
a few are going to the sea, and one or two are simply going because they like trains. The carriage
smells of coffee and wet umbrellas. A child counts the bridges out loud while her father reads the
news on his phone and nods at every number she says.

When you cook rice, rinse it first until the water runs almost clear. Use a little less water than
the packet tells you, bring it to the boil, then turn the heat down as low as it will go and put the
lid on. Do not lift the lid for twelve minutes. After that, let the pot rest off the heat for five
more minutes, and fluff the grains with a fork before you serve them.

Our town library opens at nine on weekdays and at ten on Saturdays. It has a reading room with tall
windows, a corner for children with cushions on the floor, and a small room in the basement where
you can borrow tools: drills, ladders, sewing machines and even a telescope. The librarians say the
telescope is the most popular item on clear winter nights.

A computer does not understand words. It reads numbers, and a program turns those numbers into
letters, pictures and sounds. When a language model reads a sentence, it first cuts the text into
small pieces called tokens. Some tokens are whole words, some are parts of words, and some are single
bytes. The model then predicts which token is likely to come next, one step at a time.

The weather report for tomorrow says there will be light rain in the morning, clearing by noon, with
a gentle wind from the west. Temperatures will stay between eleven and seventeen degrees. On Sunday
the sky should be bright and the air a little colder, so take a jacket if you plan to walk in the
hills or along the river.

Memory is fast but small, and storage is large but slow. Good systems keep what they will need soon
close at hand and leave the rest where it is. A cache is only useful when the same things are asked
for again and again; if every request is new, the cache just adds work. Measuring how often a cache
hits is the first step before trying to make it larger or smarter.

She planted tomatoes, beans and a row of sunflowers along the fence. By August the sunflowers were
taller than the shed, and the birds had found them. Every evening she sat on the step with a cup of
tea and watched the finches pull seeds from the heavy yellow heads while the light went orange.

Please remember to close the windows before you leave, switch off the lights in the kitchen, and put
the keys back in the blue box by the door. If anything breaks, write it down in the notebook on the
shelf so that we can fix it next week. Thank you, and have a safe journey home.
"""

KOREAN = """\
오늘 아침에는 비가 조금 내렸지만 점심이 지나면서 하늘이 맑아졌습니다. 바람은 서쪽에서 부드럽게
불었고, 공원에는 산책하는 사람들이 많았습니다. 아이들은 물웅덩이를 뛰어넘으며 웃었고, 강아지들은
젖은 풀 냄새를 맡느라 바빴습니다.

밥을 맛있게 지으려면 먼저 쌀을 물이 거의 맑아질 때까지 씻으세요. 물을 붓고 끓기 시작하면 불을
가장 약하게 줄이고 뚜껑을 덮습니다. 십이 분 동안은 뚜껑을 열지 마세요. 그 다음 불을 끄고 오 분
정도 뜸을 들인 뒤 주걱으로 가볍게 섞어 주면 됩니다.

우리 동네 도서관은 평일에는 아홉 시에, 토요일에는 열 시에 문을 엽니다. 창문이 큰 열람실이 있고,
어린이를 위한 방석 코너도 있습니다. 지하에는 공구를 빌릴 수 있는 작은 방이 있는데, 겨울밤에는
망원경이 가장 인기가 많다고 사서 선생님이 말했습니다.

컴퓨터는 글자를 직접 이해하지 못합니다. 컴퓨터는 숫자를 읽고, 프로그램이 그 숫자를 글자와 그림과
소리로 바꿉니다. 언어 모델은 문장을 읽을 때 먼저 글을 토큰이라는 작은 조각으로 나눕니다. 그리고
다음에 올 토큰을 한 번에 하나씩 예측합니다.

메모리는 빠르지만 작고, 저장 장치는 크지만 느립니다. 좋은 시스템은 곧 필요할 것을 가까이 두고
나머지는 제자리에 둡니다. 같은 요청이 여러 번 반복될 때만 캐시가 쓸모가 있습니다. 먼저 캐시가
얼마나 자주 맞는지 측정하는 것이 중요합니다.

집을 나서기 전에 창문을 닫고, 부엌 불을 끄고, 열쇠는 문 옆 파란 상자에 넣어 주세요. 고장 난
것이 있으면 선반 위 공책에 적어 주세요. 다음 주에 고치겠습니다. 감사합니다. 조심히 들어가세요.
"""


def corpus_lines() -> list[str]:
    """The corpus as a list of non-empty lines, English first, in a fixed order (deterministic training)."""
    return [line for line in (ENGLISH + KOREAN).splitlines() if line.strip()]
