package main

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/robfig/cron/v3"
)

// Specs that cannot work are refused with a reason, before anything connects.
func TestParseScheduleRefusesSpecsThatCannotWork(t *testing.T) {
	for spec, want := range map[string]string{
		"0 0 30 2 *":                          "never ticks",              // 30 February
		"0 0 31 4 *":                          "never ticks",              // 31 April
		"0 0 29 2 *":                          "ticks only in some years", // leap years: cron_spec_test.go
		"CRON_TZ=Mars/Olympus_Mons 0 3 * * *": "Mars/Olympus_Mons",
		"*/5 * * *":                           "expected 5 to 6 fields",
	} {
		if _, err := parseSchedule(spec); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("parseSchedule(%q) = %v, want an error naming %q", spec, err, want)
		}
	}
	for _, spec := range []string{"*/5 * * * *", "@hourly", "@every 10s", "CRON_TZ=Europe/Berlin 30 2 * * *", "0 0 31 * *"} {
		if _, err := parseSchedule(spec); err != nil {
			t.Errorf("parseSchedule(%q): %v", spec, err)
		}
	}
}

// previousTick and newestDue end on a schedule without ticks instead of
// spinning on robfig's zero time (issue 20: the leader sat at 98 % CPU).
func TestNoCronLoopSpinsOnAZeroTime(t *testing.T) {
	never, err := cronParser.Parse("0 0 30 2 *") // parsed directly: parseSchedule refuses it
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	done := make(chan struct{})
	go func() {
		defer close(done)
		if prev, ok := previousTick(never, now); ok {
			t.Errorf("previousTick of a spec that never matches = %s", prev)
		}
		if due := newestDue(never, now, now); !due.Equal(now) {
			t.Errorf("newestDue of a spec that never matches = %s, want the due tick itself", due)
		}
		if next := (wallClock{spec: mustSpec(t, "0 0 30 2 *")}).Next(now); !next.IsZero() {
			t.Errorf("wallClock.Next of a spec that never matches = %s", next)
		}
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("a cron helper is still looping after 10s on a spec that never matches")
	}
}

// The missed-tick rule's count: the ticks passed over between the newest
// one enqueued and the one that runs instead; none when that one is next,
// or older than a tick another leader enqueued.
func TestMissedTicks(t *testing.T) {
	s := mustSchedule("@every 10s")
	at := func(sec int) time.Time { return time.Date(2026, 12, 7, 12, 0, sec, 0, time.UTC) }
	if got, want := missedTicks(s, at(10), at(50)), (skippedTicks{count: 4, first: at(10), last: at(40)}); got != want {
		t.Errorf("missedTicks from 12:00:10 until 12:00:50 = %+v, want %+v", got, want)
	}
	for _, from := range []int{50, 60} {
		if got := missedTicks(s, at(from), at(50)); got.count != 0 {
			t.Errorf("missedTicks from 12:00:%d until 12:00:50 = %+v, want none", from, got)
		}
	}
}

func mustSpec(t *testing.T, spec string) *cron.SpecSchedule {
	t.Helper()
	s, err := cronParser.Parse(spec)
	if err != nil {
		t.Fatal(err)
	}
	return s.(*cron.SpecSchedule)
}

// ticksBetween runs a schedule the way scheduler.lead does, on a fake clock
// stepped a minute at a time from start to end: the first wait is
// schedule.Next(start); a due tick fires as newestDue, then the wait is for
// the tick after it.
func ticksBetween(t *testing.T, spec string, start, end time.Time) []string {
	t.Helper()
	s, err := parseSchedule(spec)
	if err != nil {
		t.Fatal(err)
	}
	var fired []string
	next := s.Next(start)
	for now := start; !now.After(end); now = now.Add(time.Minute) {
		if !next.IsZero() && !next.After(now) {
			tick := newestDue(s, next, now)
			fired = append(fired, tick.UTC().Format("01-02 15:04Z")+" ("+tick.In(s.(wallClock).spec.Location).Format("15:04 MST")+")")
			next = s.Next(tick)
		}
	}
	return fired
}

// The DST rule (cron.go, wallClock) on the DST days of 2026 in Berlin and
// New York: a skipped local time fires once at the first instant after the
// gap, a repeated one once, hourly schedules keep their elapsed-time spacing.
func TestCronAcrossDSTDays(t *testing.T) {
	berlin, _ := time.LoadLocation("Europe/Berlin")
	newYork, _ := time.LoadLocation("America/New_York")
	day := func(loc *time.Location, y int, m time.Month, d int) (time.Time, time.Time) {
		return time.Date(y, m, d, 0, 0, 0, 0, loc), time.Date(y, m, d+1, 0, 0, 0, 0, loc) // 23, 24 or 25 hours
	}
	for _, tc := range []struct {
		name  string
		spec  string
		loc   *time.Location
		month time.Month
		date  int
		want  []string
	}{
		{"Berlin spring forward: 02:30 is skipped, fires at 03:00 CEST", "CRON_TZ=Europe/Berlin 30 2 * * *", berlin, time.March, 29,
			[]string{"03-29 01:00Z (03:00 CEST)"}},
		{"Berlin fall back: 02:30 happens twice, fires once", "CRON_TZ=Europe/Berlin 30 2 * * *", berlin, time.October, 25,
			[]string{"10-25 00:30Z (02:30 CEST)"}},
		{"New York spring forward: 02:30 is skipped, fires at 03:00 EDT", "CRON_TZ=America/New_York 30 2 * * *", newYork, time.March, 8,
			[]string{"03-08 07:00Z (03:00 EDT)"}},
		{"New York fall back: 01:30 happens twice, fires once", "CRON_TZ=America/New_York 30 1 * * *", newYork, time.November, 1,
			[]string{"11-01 05:30Z (01:30 EDT)"}},
		{"Berlin spring forward, hourly: no tick lost or doubled", "CRON_TZ=Europe/Berlin 0 * * * *", berlin, time.March, 29,
			hourly(t, berlin, time.Date(2026, 3, 29, 0, 0, 0, 0, berlin), 23)},
		{"Berlin fall back, hourly: the repeated hour fires too", "CRON_TZ=Europe/Berlin 0 * * * *", berlin, time.October, 25,
			hourly(t, berlin, time.Date(2026, 10, 25, 0, 0, 0, 0, berlin), 25)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start, end := day(tc.loc, 2026, tc.month, tc.date)
			// The first tick at start itself is not "after start": begin a second earlier.
			got := ticksBetween(t, tc.spec, start.Add(-time.Second), end.Add(-time.Second))
			if strings.Join(got, ", ") != strings.Join(tc.want, ", ") {
				t.Errorf("fired\n  %s\nwant\n  %s", strings.Join(got, "\n  "), strings.Join(tc.want, "\n  "))
			}
		})
	}
}

// hourly lists n ticks an hour apart in elapsed time from start, as ticksBetween formats them.
func hourly(t *testing.T, loc *time.Location, start time.Time, n int) []string {
	var want []string
	for i := range n {
		at := start.Add(time.Duration(i) * time.Hour)
		want = append(want, at.UTC().Format("01-02 15:04Z")+" ("+at.In(loc).Format("15:04 MST")+")")
	}
	return want
}

// The missed-tick policy across DST: a leader taking over at any minute of
// a DST day enqueues the newest tick at or before that minute (robfig's
// interval arithmetic found none on the day after a 25-hour day).
func TestPreviousTickAcrossDSTDays(t *testing.T) {
	for _, tc := range []struct {
		spec string
		now  string
		want string
	}{
		{"CRON_TZ=Europe/Berlin 30 2 * * *", "2026-10-25T02:00:00+01:00", "2026-10-25T02:30:00+02:00"},    // in the repeated hour, after the tick
		{"CRON_TZ=Europe/Berlin 30 2 * * *", "2026-10-26T02:29:00+01:00", "2026-10-25T02:30:00+02:00"},    // the day after the 25-hour day
		{"CRON_TZ=Europe/Berlin 30 2 * * *", "2026-03-29T03:10:00+02:00", "2026-03-29T03:00:00+02:00"},    // after the skipped tick
		{"CRON_TZ=America/New_York 30 2 * * *", "2026-03-09T02:29:00-04:00", "2026-03-08T03:00:00-04:00"}, // the day after the 23-hour day
		{"CRON_TZ=America/New_York 30 2 * * *", "2026-03-08T01:59:00-05:00", "2026-03-07T02:30:00-05:00"},
		{"0 0 31 * *", "2026-12-30T00:00:00Z", "2026-10-31T00:00:00Z"}, // a 61-day gap before a 31-day one
	} {
		s, err := parseSchedule(tc.spec)
		if err != nil {
			t.Fatal(err)
		}
		prev, ok := previousTick(s, mustTime(t, tc.now))
		if want := mustTime(t, tc.want); !ok || !prev.Equal(want) {
			t.Errorf("%s at %s: previousTick = %s, %v; want %s", tc.spec, tc.now, prev, ok, want)
		}
	}
}

func mustTime(t *testing.T, s string) time.Time {
	t.Helper()
	at, err := time.Parse(time.RFC3339, s)
	if err != nil {
		t.Fatal(err)
	}
	return at
}

// A purge cron that never fires: the boot stops in phase 6 naming it, before
// anything connects (it used to boot, and its leader spun at 98 % CPU).
func TestProcessRefusesCronSpecsThatCannotWork(t *testing.T) {
	env := fastEnv(t, "KUMIKO_OUTBOX_PURGE_CRON=0 0 30 2 *")
	refusedInPhase6(t, env, `cron "0 0 30 2 *" for job purgeOutbox: it never ticks`)
}

// refusedInPhase6 boots a service with env and wants it to exit 1 in phase
// 6, its error naming every one of want, before anything connects.
func refusedInPhase6(t *testing.T, env map[string]string, want ...string) {
	t.Helper()
	p := startProc(t, env)
	if code := p.wait(10 * time.Second); code != 1 {
		t.Fatalf("exit code %d, want 1", code)
	}
	failed := p.waitLog(time.Second, map[string]any{"phase": "bootValidation", "outcome": "failed"})
	msg, _ := failed["error"].(string)
	for _, w := range want {
		if !strings.Contains(msg, w) {
			t.Errorf("bootValidation error does not say %q: %s", w, msg)
		}
	}
	if p.logsMatching(map[string]any{"phase": "dbConnect"}) != nil {
		t.Error("the boot went on past phase 6")
	}
}

// Ticks are wall-clock instants, while a timer counts elapsed time (issue
// 32: a wall-clock step delayed the next tick by the size of the step). On a
// clock the test controls — synctest's fake time for the timers, plus an
// offset it steps for the wall clock — a step of +1 h gets the newest due
// tick fired within cronRecheck and no stale one before it, the eleven it
// passed over reported as skipped; a step of −1 h fires no tick twice, and
// the schedule goes on when the clock shows its next tick again.
func TestCronFollowsAWallClockThatSteps(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var step atomic.Int64
		wall := func() time.Time { return time.Now().Round(0).Add(time.Duration(step.Load())) }
		s, err := parseSchedule("CRON_TZ=UTC */5 * * * *")
		if err != nil {
			t.Fatal(err)
		}
		var mu sync.Mutex
		var fired []string // "tick@wall time of the firing", and the ticks skipped to get there
		fire := func(_ int, tick time.Time, skipped skippedTicks) error {
			mu.Lock()
			defer mu.Unlock()
			f := tick.UTC().Format("15:04:05") + "@" + wall().UTC().Format("15:04:05")
			if skipped.count > 0 {
				f += fmt.Sprintf(" skipping %d, %s–%s", skipped.count, skipped.first.UTC().Format("15:04"), skipped.last.UTC().Format("15:04"))
			}
			fired = append(fired, f)
			return nil
		}
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error)
		go func() {
			done <- cronLoop{schedules: []cron.Schedule{s}, now: wall}.run(ctx, []time.Time{s.Next(wall())}, fire)
		}()
		firedSince := func(n int) []string {
			synctest.Wait()
			mu.Lock()
			defer mu.Unlock()
			return slices.Clone(fired[n:])
		}

		time.Sleep(6 * time.Minute) // the wall clock shows 00:06
		if got := firedSince(0); !slices.Equal(got, []string{"00:05:00@00:05:00"}) {
			t.Fatalf("before any step: fired %v", got)
		}
		step.Store(int64(time.Hour)) // 00:06 → 01:06
		time.Sleep(cronRecheck)
		if got := firedSince(1); !slices.Equal(got, []string{"01:05:00@01:06:01 skipping 11, 00:10–01:00"}) {
			t.Fatalf("a step of +1 h at 00:06: fired %v within %s, want the newest due tick 01:05 alone, the 11 before it skipped", got, cronRecheck)
		}
		time.Sleep(4*time.Minute - cronRecheck) // 01:10
		if got := firedSince(2); !slices.Equal(got, []string{"01:10:00@01:10:00"}) {
			t.Fatalf("after the step forward: fired %v, want 01:10 on time", got)
		}
		step.Store(0) // 01:10 → 00:10
		time.Sleep(time.Hour + 6*time.Minute)
		if got := firedSince(3); !slices.Equal(got, []string{"01:15:00@01:15:00"}) {
			t.Fatalf("a step of −1 h at 01:10, then 66 minutes: fired %v, want no tick twice and 01:15 when the clock shows it", got)
		}
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	})
}
