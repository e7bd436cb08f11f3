package main

import (
	"encoding/json"
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

// FuzzKeyProblem: the byte walk that keyProblem takes for valid JSON names
// the same first problem as the token walk it replaces on the request path.
func FuzzKeyProblem(f *testing.F) {
	for _, seed := range []string{
		`{"title":"Ada","parts":[{"size":"t","count":1,"weightGrams":1}]}`,
		`{"title":"Ada","title":"Bob"}`, `{"parts":[{"count":1,"count":9}]}`, `{"TITLE":1}`, `{"ſize":1}`,
		`{"tit\u006ce":1,"title":2}`, `{"a":"title","title":"\"title\"","title":3}`,
		`[{"size":1},{"size":2}]`, `{"x":{"size":1},"size":2,"y":[{"size":3,"SIZE":4}]}`, `"title"`, `{}`, `[]`,
		`{"title":"Ada","title":1} trailing`, `{"title":1,`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		if !json.Valid(raw) {
			return // keyProblem takes the token walk itself
		}
		names := []string{"title", "parts", "size", "count", "weightGrams"}
		if got, want := scanKeys(raw, names), keyProblemByTokens(raw, names); got != want {
			t.Fatalf("%q: byte walk %q, token walk %q", raw, got, want)
		}
	})
}
