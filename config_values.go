package main

import (
	"errors"
	"fmt"
	"math"
	"net"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// The kinds of setting values: how text from the file or the environment is
// parsed, checked, logged and described in the configuration reference.

// A settingValue parses text from the file or the environment into one config
// field, and renders that field for the startup log. A rejected string is
// still stored, so that checks such as "is required" don't pile on; the config
// is discarded anyway.
type settingValue interface {
	set(raw string) error
	logValue() any
	rule() string // what set accepts, for docs/configuration.md
}

// secretHolder is implemented by the values that can contain secrets.
type secretHolder interface {
	secrets() []string
}

type textValue struct{ p *string }

func (v textValue) set(raw string) error { *v.p = raw; return nil }

func (v textValue) logValue() any { return *v.p }

func (v textValue) rule() string { return "text" }

type choiceValue struct {
	p       *string
	allowed []string
}

func (v choiceValue) set(raw string) error {
	*v.p = raw
	if !slices.Contains(v.allowed, raw) {
		return fmt.Errorf("%q is not one of %s", raw, strings.Join(v.allowed, ", "))
	}
	return nil
}

func (v choiceValue) logValue() any { return *v.p }

func (v choiceValue) rule() string { return "one of " + strings.Join(v.allowed, ", ") }

// addrValue is a listen or dial address, host:port. The host may be empty
// (":8080", all interfaces) and the port may be 0 (any free port).
type addrValue struct {
	p        *string
	optional bool // empty means the feature is off
}

func (v addrValue) set(raw string) error {
	*v.p = raw
	if raw == "" && v.optional {
		return nil
	}
	_, port, err := net.SplitHostPort(raw)
	if err != nil {
		return fmt.Errorf("want host:port: %w", err)
	}
	if _, err := strconv.ParseUint(port, 10, 16); err != nil {
		return fmt.Errorf("port %q is not a number from 0 to 65535", port)
	}
	return nil
}

func (v addrValue) logValue() any { return *v.p }

func (v addrValue) rule() string {
	if v.optional {
		return "host:port or empty"
	}
	return "host:port"
}

// secretValue is a token or key. It never appears in the log or in an error.
type secretValue struct {
	p      *string
	minLen int // in characters, when set
}

func (v secretValue) set(raw string) error {
	*v.p = raw
	if n := utf8.RuneCountInString(raw); raw != "" && n < v.minLen {
		return fmt.Errorf("must be at least %d characters long, got %d", v.minLen, n)
	}
	return nil
}

func (v secretValue) logValue() any {
	if *v.p == "" {
		return ""
	}
	return redactedMark
}

func (v secretValue) rule() string {
	if v.minLen > 0 {
		return fmt.Sprintf("secret, %d+ characters", v.minLen)
	}
	return "secret"
}

func (v secretValue) secrets() []string {
	if *v.p == "" {
		return nil
	}
	return []string{*v.p}
}

// urlValue is a connection URL, which may embed a password. Errors never
// quote the URL, since they end up in logs.
type urlValue struct {
	p       *string
	schemes []string
}

func (v urlValue) set(raw string) error {
	*v.p = raw
	if raw == "" {
		return nil // optional here; validate insists on the required ones
	}
	u, err := url.Parse(raw)
	if err != nil {
		if urlErr, ok := errors.AsType[*url.Error](err); ok {
			err = urlErr.Err // the *url.Error repeats the whole URL, password included
		}
		return fmt.Errorf("not a valid URL: %w", err)
	}
	if !slices.Contains(v.schemes, u.Scheme) {
		return fmt.Errorf("the URL scheme must be one of %s, got %q", strings.Join(v.schemes, ", "), u.Scheme)
	}
	return nil
}

func (v urlValue) logValue() any { return redactConnString(*v.p) }

func (v urlValue) secrets() []string { return connPasswords(*v.p) }

func (v urlValue) rule() string { return "URL: " + strings.Join(v.schemes, ", ") }

type durationValue struct {
	p      *time.Duration
	zeroOK bool // zero is a meaningful setting, not a mistake
}

func (v durationValue) set(raw string) error {
	d, err := parseDuration(raw)
	switch {
	case err != nil:
		return err
	case d < 0:
		return fmt.Errorf("%q is negative", raw)
	case d == 0 && !v.zeroOK:
		return fmt.Errorf("must be greater than zero")
	}
	*v.p = d
	return nil
}

func (v durationValue) logValue() any { return v.p.String() }

func (v durationValue) rule() string {
	if v.zeroOK {
		return "duration, 0 allowed"
	}
	return "duration > 0"
}

// prefixListValue is a comma-separated list of addresses or CIDR ranges
// ("10.0.0.0/8, 127.0.0.1"); a bare address is a range of one.
type prefixListValue struct{ p *[]netip.Prefix }

func (v prefixListValue) set(raw string) error {
	*v.p = nil
	for _, part := range strings.Split(raw, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		prefix, err := netip.ParsePrefix(part)
		if err != nil {
			addr, addrErr := netip.ParseAddr(part)
			if addrErr != nil {
				return fmt.Errorf("%q is neither an address nor a CIDR range", part)
			}
			prefix = netip.PrefixFrom(addr, addr.BitLen())
		}
		*v.p = append(*v.p, prefix.Masked())
	}
	return nil
}

func (v prefixListValue) rule() string { return "addresses or CIDR ranges, comma-separated" }

func (v prefixListValue) logValue() any {
	parts := make([]string, len(*v.p))
	for i, p := range *v.p {
		parts[i] = p.String()
	}
	return strings.Join(parts, ",")
}

type boolValue struct{ p *bool }

func (v boolValue) set(raw string) error {
	b, err := strconv.ParseBool(raw)
	if err != nil {
		return fmt.Errorf("want true, false, 1 or 0, got %q", raw)
	}
	*v.p = b
	return nil
}

func (v boolValue) logValue() any { return *v.p }

func (v boolValue) rule() string { return "true or false" }

// uintValue is a whole number from min to max (no upper bound when max is 0).
type uintValue struct {
	p        *uint
	min, max uint
}

func (v uintValue) set(raw string) error {
	n, err := strconv.ParseUint(raw, 10, strconv.IntSize)
	if err != nil || uint(n) < v.min || (v.max > 0 && uint(n) > v.max) {
		return fmt.Errorf("want a %s, got %q", v.rule(), raw)
	}
	*v.p = uint(n)
	return nil
}

func (v uintValue) logValue() any { return *v.p }

func (v uintValue) rule() string {
	if v.max > 0 {
		return fmt.Sprintf("whole number from %d to %d", v.min, v.max)
	}
	return fmt.Sprintf("whole number, %d or more", v.min)
}

// parseDuration parses a Go duration ("250ms", "1m30s") or a bare number of
// seconds ("3", "0.5"), which the spec promises and the former *Sec keys meant.
func parseDuration(s string) (time.Duration, error) {
	if secs, err := strconv.ParseFloat(s, 64); err == nil {
		ns := math.Round(secs * float64(time.Second))
		// float64(math.MaxInt64) rounds up to 2⁶³, one past the largest Duration.
		if math.IsNaN(ns) || ns >= math.MaxInt64 || ns < math.MinInt64 {
			return 0, fmt.Errorf("%q seconds is out of range", s)
		}
		return time.Duration(ns), nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, fmt.Errorf("%w (want seconds like 3 or 0.5, or a duration like 250ms or 1m30s)", err)
	}
	return d, nil
}

// Connection strings.
