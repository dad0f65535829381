"""The KV codec gate's text when the shared public one (`../shared/texts/gpl-3.0.txt`) is not beside the
repository (an installed package): short plain English prose written for pdserve, fixed, so every host scores
the same tokens (`pdserve.engine.codec_gate`)."""

NAME = "pdserve gate text"

TEXT = """\
The river begins as a thin stream high in the hills, where snow melts slowly through the spring and the water runs
cold and clear over grey stones. Farther down, other streams join it, and by the time it reaches the first village
it is wide enough that the people there have built a wooden bridge across it. The bridge is old. Its boards have
been replaced many times, but the posts that hold it up were cut from oak trees more than a hundred years ago, and
the villagers say that they will stand for another hundred if nobody is careless with them.

In the summer, children swim in the slow pools below the bridge while their parents work in the fields on either
bank. The fields grow wheat, barley and potatoes, and in a good year there is enough to sell in the market town
that lies a day's walk to the south. In a bad year, when the rain comes too late or too early, the village keeps
what it has and waits for the next harvest. Nobody there expects every year to be good. They plan for the bad ones,
store grain in dry barns, and share with neighbours who have less.

The market town is different. It sits where the river meets a road that runs from the coast to the mountains, and
for as long as anyone remembers, traders have stopped there to rest their horses, buy food and sell what they have
carried. The town has a square with a clock tower, a school, two churches, a library and a great many shops. On
market days the square is full of stalls selling cloth, tools, bread, cheese, fruit and fish brought up from the
sea that morning in carts packed with ice.

A teacher at the school once asked her students to write down everything that passed through the town in a single
week. They counted wagons and walkers, sheep and goats, letters at the post office and boats on the river. At the
end of the week they added up their numbers and drew a large map on the classroom wall, with arrows showing where
each thing had come from and where it was going. The map stayed on the wall for many years, and students who had
long since grown up would come back to look at it and remember the week they learned how many small journeys make
up the life of one ordinary place.

Below the town the river grows slower and wider still. It bends through marshes where herons stand in the shallow
water and wait for fish, and then it passes between low green hills until, at last, it reaches the sea. There the
fresh water and the salt water mix, the tide comes in and goes out twice a day, and the long journey that began
with melting snow in the hills comes quietly to an end.
"""
