package main

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/labstack/echo/v4"
)

// FuzzDecodeOrder feeds arbitrary bodies to the order decoder. It must never
// panic, must answer every refusal with a 4xx, and what it accepts must be an
// order every rule holds for, which encodes and decodes back to itself.
// scripts/test.sh runs it for a few seconds on every test run.
func FuzzDecodeOrder(f *testing.F) {
	for _, seed := range []string{
		validOrder,
		`{"customer":"\ud800","items":[{"sku":"t","qty":1,"priceCents":1}]}`,
		`{"customer":"Ada","customer":"Bob","items":[{"sku":"t","qty":1,"priceCents":1}]}`,
		`{"CUSTOMER":"Ada","items":[{"sku":"t","qty":1,"priceCents":1}]}`,
		`{"customer":"\u200b","items":[{"sku":"t","qty":1,"priceCents":1}]}`,
		`{"customer":"A\u202eB","items":[{"sku":"t","qty":1,"priceCents":1}]}`,
		`{"customer":"Ada","items":[{"sku":"t","qty":1,"priceCents":1}]}{}`,
		`{"customer":"Ada","items":[[{"sku":{}}]]}`,
		`[]`, `"x"`, `{`, "",
	} {
		f.Add([]byte(seed))
	}
	e := echo.New()
	f.Fuzz(func(t *testing.T, body []byte) {
		req := httptest.NewRequest(http.MethodPost, "/api/orders", strings.NewReader(string(body)))
		req.Header.Set("Content-Type", "application/json")
		o, err := decodeOrder(e.NewContext(req, httptest.NewRecorder()))
		if err != nil {
			he, ok := err.(*echo.HTTPError)
			if !ok || he.Code < 400 || he.Code > 499 {
				t.Fatalf("refused %q with %v, want a 4xx", body, err)
			}
			return
		}
		if problems := o.validate(); len(problems) > 0 {
			t.Fatalf("accepted %q breaking its rules: %v", body, problems)
		}
		for _, text := range append([]string{o.Customer}, skus(o)...) {
			if !utf8.ValidString(text) || textProblem(text) != "" || !visible(text) {
				t.Fatalf("accepted %q with the text %q", body, text)
			}
		}
		again, _ := json.Marshal(o)
		req = httptest.NewRequest(http.MethodPost, "/api/orders", strings.NewReader(string(again)))
		req.Header.Set("Content-Type", "application/json")
		o2, err := decodeOrder(e.NewContext(req, httptest.NewRecorder()))
		if err != nil || o2.fingerprint() != o.fingerprint() {
			t.Fatalf("accepted %q, but its own encoding %s decodes to %+v, %v", body, again, o2, err)
		}
	})
}

func skus(o newOrder) []string {
	var out []string
	for _, it := range o.Items {
		out = append(out, it.SKU)
	}
	return out
}

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
