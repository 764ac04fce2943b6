//! Query strings (`application/x-www-form-urlencoded`), decoded once for
//! every server: the session API of both servers, Durable Streams, and the
//! test kit's bridge referee. The `form_urlencoded` and `percent-encoding`
//! crates do the decoding: `+` is a space, `%XX` a byte only with two hex
//! digits (a malformed escape stays as it is), bytes that are not UTF-8
//! become U+FFFD.

/// All `(name, value)` pairs of a query string (without its `?`), in
/// order, decoded; a repeated name appears each time, empty pieces
/// between `&`s not at all. A caller that wants one value per name
/// collects them into a map, which keeps the last.
pub fn query_pairs(query: &str) -> Vec<(String, String)> {
    form_urlencoded::parse(query.as_bytes())
        .map(|(name, value)| (name.into_owned(), value.into_owned()))
        .collect()
}

/// One query component decoded as [`query_pairs`] decodes names and
/// values: `+` is a space, `%XX` a byte only with two hex digits.
pub fn percent_decode(component: &str) -> String {
    percent_encoding::percent_decode_str(&component.replace('+', " "))
        .decode_utf8_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_decode_in_order_and_keep_duplicates() {
        let pairs = query_pairs("offset=1&&offset=2&cursor=%31%32&x&a+b=c%20d+e");
        let pairs: Vec<(&str, &str)> = pairs
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            pairs,
            [
                ("offset", "1"),
                ("offset", "2"),
                ("cursor", "12"),
                ("x", ""),
                ("a b", "c d e"),
            ]
        );
        assert!(query_pairs("").is_empty());
    }

    #[test]
    fn a_map_of_the_pairs_keeps_the_last_value() {
        let map: std::collections::HashMap<_, _> =
            query_pairs("after=1&after=2").into_iter().collect();
        assert_eq!(map["after"], "2");
    }

    #[test]
    fn percent_decode_needs_two_hex_digits() {
        // Found by fuzzing: `from_str_radix` took `+1` as a number.
        assert_eq!(percent_decode("%+1x"), "% 1x");
        assert_eq!(percent_decode("%4"), "%4");
        assert_eq!(percent_decode("%4g%41"), "%4gA");
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz"), "%zz");
        assert_eq!(percent_decode("%C3%A9%FF"), "é\u{fffd}");
        // The same rules inside a query.
        assert_eq!(query_pairs("v=%+1x%4")[0].1, "% 1x%4");
    }
}
