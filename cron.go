package main

import (
	"context"
	"fmt"
	"time"

	"github.com/robfig/cron/v3"
)

// cronParser accepts standard 5-field specs, an optional seconds field,
// descriptors such as @hourly or @every 10s, and a CRON_TZ=<zone> prefix.
var cronParser = cron.NewParser(cron.SecondOptional | cron.Minute | cron.Hour | cron.Dom | cron.Month | cron.Dow | cron.Descriptor)

// maxCronGap bounds how far back previousTick looks for a tick, twice over:
// an accepted spec ticks in every calendar year (checkSpec, cron_spec.go),
// so its ticks are never much more than a year apart. robfig gives up after
// five years and returns the zero time.
const maxCronGap = 366 * 24 * time.Hour

// parseSchedule turns a cron spec into the schedule the scheduler runs: an
// "@every" interval aligned to multiples of itself, a spec in a time zone
// with the DST rule of wallClock. It refuses a spec that does not parse,
// names a time zone that does not exist, or does not mean what it says
// (checkSpec) — the same way on any day.
func parseSchedule(spec string) (cron.Schedule, error) {
	parsed, err := cronParser.Parse(spec)
	if err != nil {
		return nil, err // robfig names the field or the time zone
	}
	var s cron.Schedule
	switch p := parsed.(type) {
	case cron.ConstantDelaySchedule:
		s = everySchedule(p.Delay)
	case *cron.SpecSchedule:
		s = wallClock{spec: p}
	default:
		s = parsed
	}
	if err := checkSpec(spec, s); err != nil {
		return nil, err
	}
	return s, nil
}

// everySchedule is "@every d" ticking on multiples of d (robfig counts it
// from whenever Next is asked), so every leader computes the same tick
// times: the unique key (job, tick) then dedupes across a take-over, and the
// take-over tick is a real tick. An interval is elapsed time: DST does not
// touch it.
type everySchedule time.Duration

func (e everySchedule) Next(t time.Time) time.Time {
	return t.Truncate(time.Duration(e)).Add(time.Duration(e))
}

// wallClock runs a cron spec on the local wall clock of its time zone
// (CRON_TZ=…, else the process's local zone) with one rule for the two DST
// days, so a tick neither vanishes nor doubles:
//
//   - a local time the clock skips (02:30 on a spring-forward night) fires
//     once, at the first instant after the gap (03:00 new time);
//   - a local time the clock repeats (02:30 on a fall-back night) fires
//     once, at its first occurrence — unless the spec's hour field is "*"
//     (hourly or more often): such a schedule is about elapsed time and also
//     fires in the repeated hour, as Vixie cron does.
//
// robfig's own Next steps instants through the zone and, across DST, fires
// "30 2 * * *" twice in Berlin's fall-back night and not at all in New York's
// spring-forward night.
type wallClock struct{ spec *cron.SpecSchedule }

// starBit is robfig's mark of a field written as "*" (or "*/n").
const starBit = 1 << 63

func (w wallClock) Next(t time.Time) time.Time {
	loc := w.spec.Location
	// The spec matched against wall-clock fields written as UTC, where no
	// DST exists; each match is then mapped back to an instant.
	naive := *w.spec
	naive.Location = time.UTC
	local := t.In(loc)
	wall := time.Date(local.Year(), local.Month(), local.Day(), local.Hour(), local.Minute(), local.Second(), local.Nanosecond(), time.UTC)
	// A second back, so t's own wall time is looked at again: in a repeated
	// hour its second occurrence is still ahead. Only instants after t count.
	wall = wall.Add(-time.Second)
	repeatsFire := w.spec.Hour&starBit != 0
	for {
		wall = naive.Next(wall)
		if wall.IsZero() {
			return time.Time{}
		}
		for _, at := range instantsOf(wall, loc) {
			if at.After(t) {
				return at
			}
			if !repeatsFire {
				break // a repeated local time fires at its first occurrence only
			}
		}
	}
}

// instantsOf is the instants, earliest first, at which the clock of loc
// shows wall (given as UTC fields): one on an ordinary day, two in a
// repeated hour, and for a skipped time the first instant after the gap.
func instantsOf(wall time.Time, loc *time.Location) []time.Time {
	// Zones change their offset at most a few times a year, so the offsets in
	// force a day either side are every offset the wall time can have.
	_, before := wall.Add(-24 * time.Hour).In(loc).Zone()
	_, after := wall.Add(24 * time.Hour).In(loc).Zone()
	var at []time.Time
	for _, off := range []int{before, after} {
		c := wall.Add(-time.Duration(off) * time.Second)
		if _, o := c.In(loc).Zone(); o == off && (len(at) == 0 || !c.Equal(at[0])) {
			at = append(at, c)
		}
	}
	switch {
	case len(at) == 0: // skipped: the gap ends where the earlier candidate's zone ends
		_, end := wall.Add(-time.Duration(after) * time.Second).In(loc).ZoneBounds()
		return []time.Time{end}
	case len(at) == 2 && at[1].Before(at[0]):
		at[0], at[1] = at[1], at[0]
	}
	return at
}

// previousTick is the newest tick at or before now: the tick of the interval
// now lies in, which a new leader enqueues (a no-op when the previous leader
// did). The interval before now may be longer than the one after it (a DST
// night, a 31-day month after a 30-day one), so the search looks further
// back until it finds a tick. A schedule without ticks has none, and no loop
// here can spin on robfig's zero time.
func previousTick(s cron.Schedule, now time.Time) (time.Time, bool) {
	next := s.Next(now)
	if next.IsZero() {
		return time.Time{}, false
	}
	after := s.Next(next)
	if after.IsZero() {
		return time.Time{}, false
	}
	for back := after.Sub(next) + time.Second; back <= 2*maxCronGap; back *= 2 {
		var prev time.Time
		for t := s.Next(now.Add(-back)); !t.IsZero() && !t.After(now); t = s.Next(t) {
			prev = t
		}
		if !prev.IsZero() {
			return prev, true
		}
	}
	return time.Time{}, false
}

// newestDue is the tick to fire when due, the oldest tick not yet fired, is
// at or before now: due itself, or the newest tick at or before now when the
// scheduler woke late (a paused process, a slow enqueue, a wall clock that
// stepped forward). The missed-tick rule: the newest missed tick runs, once;
// the older ones are skipped (a report is about now, not a backlog), and
// missedTicks says which, for the log and kumiko_cron_ticks_skipped_total.
func newestDue(s cron.Schedule, due, now time.Time) time.Time {
	for {
		after := s.Next(due)
		if after.IsZero() || after.After(now) {
			return due
		}
		due = after
	}
}

// skippedTicks is the ticks a leader passed over to run a newer one: how
// many, the first and the last.
type skippedTicks struct {
	count       int
	first, last time.Time
}

// missedTicks is the ticks of s from from (a tick) up to, not including,
// until: the ones passed over when until runs instead.
func missedTicks(s cron.Schedule, from, until time.Time) skippedTicks {
	var m skippedTicks
	for t := from; !t.IsZero() && t.Before(until); t = s.Next(t) {
		if m.count == 0 {
			m.first = t
		}
		m.last, m.count = t, m.count+1
	}
	return m
}

// cronLoop fires the ticks of schedules on the wall clock.
type cronLoop struct {
	schedules []cron.Schedule
	now       func() time.Time // the wall clock; nil: time.Now (a test steps its own)
}

// run waits for the earliest of next (each schedule's next tick), fires
// every schedule whose tick is due (newestDue, with the ticks it passed
// over) and moves it on, until ctx ends (nil) or fire fails (its error). A
// wall clock that steps forward gets the newest due tick fired within
// cronRecheck; one that steps back fires no tick twice: each schedule goes
// on from its last fired tick when the clock shows it again.
func (l cronLoop) run(ctx context.Context, next []time.Time, fire func(i int, tick time.Time, skipped skippedTicks) error) error {
	timer := time.NewTimer(l.wait(next))
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-timer.C:
			now := l.clock()
			for i, s := range l.schedules {
				if next[i].IsZero() || next[i].After(now) {
					continue // zero: a spec that never matches (robfig gives up after 5 years)
				}
				tick := newestDue(s, next[i], now)
				if err := fire(i, tick, missedTicks(s, next[i], tick)); err != nil {
					return err
				}
				next[i] = s.Next(tick)
			}
			timer.Reset(l.wait(next))
		}
	}
}

// wait is the time to the earliest next tick on the wall clock, at most cronRecheck.
func (l cronLoop) wait(next []time.Time) time.Duration {
	now := l.clock()
	first := now.Add(cronRecheck)
	for _, t := range next {
		if !t.IsZero() && t.Before(first) {
			first = t
		}
	}
	return first.Sub(now)
}

func (l cronLoop) clock() time.Time {
	if l.now != nil {
		return l.now()
	}
	return time.Now()
}

// mustSchedule is parseSchedule for a spec phase 6 has already validated.
func mustSchedule(spec string) cron.Schedule {
	s, err := parseSchedule(spec)
	if err != nil {
		panic(fmt.Sprintf("cron spec %q passed bootValidation but is refused now: %v", spec, err))
	}
	return s
}
