package main

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/robfig/cron/v3"
)

// What a cron spec must mean to be accepted (phase 6, through parseSchedule).
// robfig parses more than it can honour, and answers by running something
// else: "@every 1500ms", "@every 0s" and "@every -1s" all run every second,
// and "*/61" in the minute field runs once an hour. A date that exists only
// in some years ("0 0 29 2 *") made the boot depend on the day it ran: robfig
// looks five years ahead and the old check one, so the same config was
// refused in December 2026 and accepted from March 2027. The rules here
// depend on the spec alone:
//
//   - "@every d": d is a whole number of seconds, at least one;
//   - a step ("*/n", "a-b/n") is at most the number of values of its field
//     (60 minutes, 24 hours, 31 days, 12 months, 7 weekdays): a larger one
//     cannot mean "every n";
//   - a spec ticks in every calendar year. It is tried in each of the 28
//     years from 2001, which hold every calendar there is until 2100 (leap
//     or not, starting on each weekday), never in the years around today.
//     "0 0 29 2 *" and "0 0 30 2 *" are refused; "0 0 31 * *" (seven months
//     a year) is accepted.

// checkSpec refuses spec unless it means what it says. s is spec as robfig
// parsed it.
func checkSpec(spec string, s cron.Schedule) error {
	body := spec
	if strings.HasPrefix(body, "TZ=") || strings.HasPrefix(body, "CRON_TZ=") {
		_, body, _ = strings.Cut(body, " ") // robfig has checked the zone
		body = strings.TrimSpace(body)
	}
	if rest, ok := strings.CutPrefix(body, "@every "); ok {
		d, err := time.ParseDuration(strings.TrimSpace(rest))
		if err != nil || d < time.Second || d%time.Second != 0 {
			return fmt.Errorf("@every %s: the interval must be a whole number of seconds, at least 1s", strings.TrimSpace(rest))
		}
		return nil // an interval ticks in every year
	}
	if !strings.HasPrefix(body, "@") { // the other descriptors (@hourly …) are what they say
		if err := checkSteps(strings.Fields(body)); err != nil {
			return err
		}
	}
	return ticksEveryYear(s)
}

// checkSteps refuses a step larger than its field's number of values.
func checkSteps(fields []string) error {
	// The fields of a 6-field spec; a 5-field spec has no seconds.
	cronFields := [...]struct {
		name   string
		values int
	}{{"second", 60}, {"minute", 60}, {"hour", 24}, {"day of month", 31}, {"month", 12}, {"day of week", 7}}
	skip := len(cronFields) - len(fields) // 1: no seconds field
	if skip < 0 || skip > 1 {
		return nil // robfig has refused it already
	}
	var problems []error
	for i, field := range fields {
		f := cronFields[i+skip]
		for part := range strings.SplitSeq(field, ",") {
			_, step, ok := strings.Cut(part, "/")
			if !ok {
				continue
			}
			if n, err := strconv.Atoi(step); err == nil && n > f.values {
				problems = append(problems, fmt.Errorf("%s field %q: a step of %d is more than the %d values the field has; it would tick once per %s cycle, not every %d",
					f.name, part, n, f.values, strings.TrimPrefix(f.name, "day of "), n))
			}
		}
	}
	return errors.Join(problems...)
}

// ticksEveryYear refuses a schedule that has no tick in some calendar year.
func ticksEveryYear(s cron.Schedule) error {
	loc := time.UTC
	if spec, ok := s.(wallClock); ok {
		loc = spec.spec.Location
	}
	var missing []int
	for year := 2001; year < 2001+28; year++ {
		start, end := time.Date(year, 1, 1, 0, 0, 0, 0, loc), time.Date(year+1, 1, 1, 0, 0, 0, 0, loc)
		if next := s.Next(start.Add(-time.Nanosecond)); next.IsZero() || !next.Before(end) {
			missing = append(missing, year)
		}
	}
	switch {
	case len(missing) == 28:
		return errors.New("it never ticks")
	case len(missing) > 0:
		return fmt.Errorf("it ticks only in some years (none in %d, for one): a spec must tick every year, so that whether it is accepted does not depend on the date", missing[0])
	}
	return nil
}
