package main

import (
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/labstack/echo/v4"
)

// FuzzParseLastEventID: an id is accepted exactly when it is decimal digits
// that fit an int64, and then means that number; anything else is a 400.
func FuzzParseLastEventID(f *testing.F) {
	for _, seed := range []string{"0", "1", "42", "007", "-1", "+5", " 5", "5 ", "0x10", "1e3", "9223372036854775807",
		"9223372036854775808", "99999999999999999999", "", "٣", "1\x00"} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, s string) {
		id, err := parseLastEventID(s)
		want, perr := strconv.ParseUint(s, 10, 63)
		digits := s != "" && strings.Trim(s, "0123456789") == ""
		switch {
		case err == nil && (!digits || perr != nil || int64(want) != id):
			t.Fatalf("parseLastEventID(%q) = %d, want a refusal or %d", s, id, want)
		case err != nil && digits && perr == nil:
			t.Fatalf("parseLastEventID(%q) refused an id: %v", s, err)
		case err != nil:
			if he, ok := err.(*echo.HTTPError); !ok || he.Code != http.StatusBadRequest {
				t.Fatalf("parseLastEventID(%q) = %v, want a 400", s, err)
			}
		}
	})
}
