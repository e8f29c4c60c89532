"""A plain English sample text (about 400 words) on which routing is measured (`info`, docs/synth.md)."""

from __future__ import annotations

SAMPLE_TEXT = """\
Every autumn the old orchard at the edge of the village fills with people. Families arrive early with
baskets and ladders, and the children run ahead to find the trees with the reddest apples. The farmer,
a tall woman with a quiet voice, walks between the rows and tells everyone which trees are ready and
which need another week of sun. She has looked after the orchard for thirty years, and she still
writes the date of the first harvest in a small green notebook that she keeps in her coat pocket.

By noon the grass is covered with fallen leaves and the air smells of fruit. Some visitors sit on the
low stone wall to eat their lunch, while others carry their full baskets to the barn, where the apples
are weighed on an iron scale older than anyone in the village. The price has not changed in years:
one coin for a small bag, three for a large one, and nothing at all for the bruised apples that go
into the cider press behind the barn.

In the afternoon the light turns golden and the shadows grow long across the hill. A group of students
from the town has come to measure the trees for a school project. They count the branches, write down
the height of each trunk, and argue about whether the oldest tree is a hundred years old or only
eighty. The farmer laughs and tells them that the tree was already tall when her grandfather bought
the land, so they should believe the larger number.

When the sun goes down, the visitors drive home along the narrow road, and the orchard becomes quiet
again. Only the sound of the wind in the branches remains, and now and then the soft thump of an apple
dropping into the grass. Inside the farmhouse, the farmer lights the stove, makes a pot of tea, and
opens her notebook to add a line: the weather was fine, the harvest was good, and many people came.

Next spring the trees will blossom again, first white and then pink, and the bees will move from
flower to flower for a few busy weeks. Nobody in the village can say exactly how the orchard will look
in another thirty years, but most of them hope that someone will still be there to open the gate,
welcome the families, and write the first date of the harvest in a small green notebook.
"""
