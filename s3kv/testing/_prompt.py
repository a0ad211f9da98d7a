"""The English prompt whose KV cache serves as realistic test and benchmark data.

Written for this project (no third-party text): an operations report with numbers and open
questions, about 1,500 words, so that one forward pass of SmolLM2 yields about 2,000 tokens.
Changing the text changes every cached KV file (the cache key includes its digest).
"""

from __future__ import annotations

from typing import Final

PROMPT_TEXT: Final = """\
Quarterly Operations Report: Northern Distribution Network, Third Quarter

Prepared by the regional operations team for the steering committee. This report covers
the three warehouses in the northern region, the line-haul fleet that connects them, the
customer service desk, and the platform team that runs the order management system. Where
figures are estimates we say so, and where we are unsure of a cause we list the open
question rather than guess.

1. Summary

The quarter closed with 1,284,000 orders shipped, up 9.4 percent on the second quarter and
17.1 percent on the same quarter last year. On-time delivery, measured as the share of
parcels delivered on or before the promised date, was 94.2 percent against a target of 96
percent. The miss is concentrated in two weeks of August, when the Riverside warehouse lost
its main conveyor for four days and the Hillcrest depot was short of drivers during the
holiday period. Outside those two weeks, on-time delivery averaged 96.3 percent. Cost per
order fell from 4.81 to 4.62, mostly because the new routing software reduced empty
kilometres by about 11 percent. Customer complaints rose slightly, from 3.1 to 3.4 per
thousand orders, and the single largest category remains damaged packaging on heavy items.

2. Warehouses

Riverside handled 612,000 orders, Hillcrest 401,000 and Lakeside 271,000. Riverside is the
oldest site and it shows: the main sortation conveyor, installed eleven years ago, failed on
the morning of August 12 when a drive gearbox seized. The maintenance contractor had a
replacement gearbox in stock at its central depot, but the fitting required a specialist who
was working at another customer's site, and the line did not restart until the afternoon of
August 15. During those four days the team sorted by hand, at roughly 38 percent of normal
throughput, and diverted about 19,000 orders to Hillcrest. We estimate the failure cost
212,000 in overtime, expedited transport and service credits. The contractor's report
attributes the failure to lubricant breakdown, and notes that the gearbox had last been
inspected fourteen months earlier, although the maintenance plan says every six months.

Question for the committee: should we keep the current contractor, whose response time
was poor this time but who has otherwise met its service levels for six years, or tender the
contract this winter? The procurement team estimates a tender would take five months.

Hillcrest ran close to capacity for most of the quarter, at an average of 91 percent of its
rated throughput and a peak of 104 percent during the diversion week. The site manager has
asked for a second shift on the packing line from October, which would cost about 38,000 a
month and raise capacity by roughly 30 percent. Lakeside, by contrast, ran at 62 percent of
capacity. Its location is less convenient for the eastern customers, and the line-haul
cost from Lakeside to the eastern delivery zones is about 14 percent higher per pallet than
from Hillcrest. One option is to move the slow-moving stock from Hillcrest to Lakeside,
freeing about 2,400 pallet positions at Hillcrest for fast movers; another is to rebalance
the delivery zones so that Lakeside serves the two southern districts that Hillcrest serves
today. The planning team has modelled both options and prefers the first, which it expects
to save 160,000 a year, but the model assumes that demand for slow movers stays flat, and
we have no good forecast for that.

Inventory accuracy, measured by weekly cycle counts, was 99.1 percent at Riverside, 99.4
percent at Hillcrest and 98.2 percent at Lakeside. The Lakeside figure is below the 99
percent target for the second quarter running. The site team believes most of the
discrepancies come from returns that are put away before they are scanned, and it has
started a trial in which returns wait in a quarantine area until a second person scans
them. Early results from the first three weeks of the trial show accuracy of 98.9 percent.

3. Transport

The line-haul fleet ran 46 tractor units and 71 trailers, and covered 3.9 million
kilometres in the quarter. Fuel consumption averaged 29.8 litres per hundred kilometres,
down from 31.2, which we attribute to the driver training programme completed in June and to
the lower share of empty running. The routing software, rolled out to all three depots in
July, plans loads overnight and reroutes during the day when a vehicle is delayed. Empty
kilometres fell from 18.6 percent of the total to 16.5 percent. Two tractors were off the
road for more than ten days each because of parts shortages, and we have since agreed a
priority parts arrangement with the dealer.

Driver availability is the larger risk. We employ 118 drivers and use agency drivers for
peaks. In the first two weeks of August, 21 of our drivers were on leave at the same time,
and the agency could supply only 9 of the 15 extra drivers we asked for. The leave policy
allows up to 15 percent of drivers on leave in any week; it was exceeded because leave had
been approved at the depot level without a central view. The human resources team has now
added a regional calendar, and the policy will be enforced from the fourth quarter. We
also want to discuss whether to raise the agency rate, which is below the market rate by
about 8 percent according to the agency itself.

Parcel carriers handled the last mile for 41 percent of orders, mainly in rural areas.
Their on-time rate was 92.8 percent, lower than our own vans at 95.1 percent. One carrier,
responsible for about a third of the rural volume, had an on-time rate of 89.4 percent and
lost or damaged 0.6 percent of parcels, twice the contractual limit. Service credits of
44,000 were claimed. The carrier has proposed a recovery plan that adds a sorting shift at
its hub; we will review its performance again at the end of November.

4. Customer service

The service desk received 96,500 contacts, of which 61 percent were by chat, 27 percent by
email and 12 percent by phone. The median first response time was 3 minutes for chat, 5
hours for email and 2 minutes for phone. Email response time is outside the 4-hour target,
largely because of the August backlog, which peaked at 6,800 open tickets. The top three
reasons for contact were "where is my order" (38 percent), damaged items (17 percent) and
address changes (11 percent). A self-service tracking page with live vehicle positions went
live in September and, in its first four weeks, the share of "where is my order" contacts
fell to 29 percent. Customer satisfaction, from the post-contact survey, was 4.1 out of 5,
unchanged from the previous quarter.

Damaged packaging remains the main quality problem. Heavy items, above 20 kilograms, are
3 percent of orders but 31 percent of damage claims. The packaging team tested a double-wall
carton with corner protectors on 4,000 heavy orders in September, and damage claims on
those orders fell by about two thirds. The carton costs 0.74 more per order. At current
volumes that is roughly 110,000 a year, against damage claims on heavy items of about
260,000 a year. We recommend adopting it, subject to the committee's view.

5. Platform and systems

The order management system processed 2.9 million order events per day on average, with a
peak of 7.4 million on the first Monday of September. Availability was 99.93 percent,
against a target of 99.9 percent. There were two incidents. On July 22 a database failover
took 11 minutes instead of the expected 30 seconds because a replication setting had been
changed during an upgrade and not reverted; orders were queued and none were lost. On
September 9 a certificate on the carrier integration expired, and label printing failed for
47 minutes at two depots. Both incidents have post-incident reviews with actions; the
certificate expiry is now monitored, and configuration changes to the database cluster now
need a second reviewer.

The platform team also moved the pricing and inventory services to the new container
cluster. Response times at the 99th percentile fell from 420 milliseconds to 180, and the
monthly infrastructure bill for those services fell by about 22 percent. The remaining
services move in the fourth quarter. The team has asked whether it should also move the
reporting database, which is large and rarely changed; the estimate is six weeks of work
for a saving of about 3,000 a month, and the team is not sure it is worth it this year.

6. People and safety

Headcount at the end of the quarter was 1,046, including 118 drivers and 74 service desk
staff. Voluntary turnover was 4.3 percent for the quarter, down from 5.1. There were three
reportable safety incidents, all minor: two slips in the Riverside loading area during wet
weather and one strain injury while lifting a heavy parcel by hand during the conveyor
outage. The loading area has new drainage and anti-slip coating since September.

7. Outlook and decisions requested

For the fourth quarter we forecast 1.45 million orders, with a peak week in early December
of about 160,000 orders. To meet it we need the second shift at Hillcrest, the agency rate
decision, and confidence that the Riverside conveyor will hold. The committee is asked to
decide: first, whether to approve the Hillcrest second shift from October; second, whether
to tender the Riverside maintenance contract; third, whether to adopt the double-wall carton
for heavy items; and fourth, whether to move slow-moving stock to Lakeside before the peak
or after it. We would also welcome the committee's view on two open questions. What level of
spare parts should we hold on site for equipment older than ten years? And how should we
measure on-time delivery for orders that customers reschedule themselves, which today count
as late?

Given the figures above, which single action would most improve on-time delivery in the
fourth quarter, and what would it cost?
"""
