package main

import (
	"strings"
	"testing"
	"time"
)

// A spec is accepted only if it means what it says (issue 33): robfig ran
// each refused one as something else — every second, once an hour — or
// accepted it on some days and not others.
func TestCronSpecMeansWhatItSays(t *testing.T) {
	for spec, want := range map[string]string{
		"@every 1ms":                          "whole number of seconds, at least 1s",
		"@every 0s":                           "whole number of seconds, at least 1s",
		"@every -1s":                          "whole number of seconds, at least 1s",
		"@every 1500ms":                       "whole number of seconds, at least 1s",
		"CRON_TZ=Europe/Berlin @every 500ms":  "whole number of seconds, at least 1s",
		"*/61 * * * *":                        `minute field "*/61": a step of 61 is more than the 60 values`,
		"0 */25 * * *":                        `hour field "*/25"`,
		"*/90 * * * * *":                      `second field "*/90"`,
		"0 0 1-10/32 * *":                     `day of month field "1-10/32"`,
		"0 0 1 */13 *":                        `month field "*/13"`,
		"0 0 * * 1/8":                         `day of week field "1/8"`,
		"0 0 29 2 *":                          "ticks only in some years (none in 2001",
		"0 0 12 29 2 *":                       "ticks only in some years", // with seconds
		"CRON_TZ=America/New_York 0 0 29 2 *": "ticks only in some years",
		"0 0 30 2 *":                          "never ticks",
	} {
		if _, err := parseSchedule(spec); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("parseSchedule(%q) = %v, want an error saying %q", spec, err, want)
		}
	}
	for _, spec := range []string{"@every 1s", "@every 90s", "@every 1h30m", "@hourly", "@yearly", "*/60 * * * *",
		"*/5 * * * *", "0 0 */31 * *", "0 0 1 */12 *", "0 0 * * */7", "*/30 * * * * *", "0 0 13 * 5", "0 0 31 * *",
		"0 0 1 1 *", "CRON_TZ=Europe/Berlin 30 2 * * *", "0 9 * * MON-FRI", "0 0 1 JAN/3 *",
		"0 0 29 2 1"} { // day of month or of week: every Monday of February, and 29 February
		if _, err := parseSchedule(spec); err != nil {
			t.Errorf("parseSchedule(%q): %v", spec, err)
		}
	}
}

// The answer for a spec does not depend on the date: "0 0 29 2 *" was refused
// in December 2026 and accepted from March 2027. Nothing in the check reads
// the clock, so asking on any day is asking on every day; this pins that the
// refusal names a fixed year, not one near today.
func TestCronSpecCheckIgnoresTheDate(t *testing.T) {
	_, err := parseSchedule("0 0 29 2 *")
	if err == nil || !strings.Contains(err.Error(), "none in 2001") {
		t.Fatalf("0 0 29 2 * on %s: %v, want refused for a fixed year", time.Now().Format(time.DateOnly), err)
	}
}
