//! When an X.509 certificate is valid (its `notBefore` and `notAfter`),
//! read from its DER: a server certificate rotated to one that expired, or
//! is not valid yet, would make every client refuse the server, and a
//! reload must keep the one in force instead (README, Security).

/// A certificate's validity, in seconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    pub not_before: i64,
    pub not_after: i64,
}

impl Validity {
    /// Why the certificate is not valid at `now` (seconds since the epoch).
    pub fn not_valid_at(&self, now: i64) -> Option<String> {
        if now < self.not_before {
            return Some(format!("not valid before {}", rfc3339(self.not_before)));
        }
        (now > self.not_after).then(|| format!("expired at {}", rfc3339(self.not_after)))
    }
}

/// The validity of the certificate `der`; `None` when it is not shaped as
/// one (rustls judges such a certificate itself).
pub fn of_certificate(der: &[u8]) -> Option<Validity> {
    let (certificate, _) = element(der, 0x30)?;
    let (mut tbs, _) = element(certificate, 0x30)?;
    // [0] EXPLICIT version, when present; then the serial number, the
    // signature algorithm and the issuer.
    if tbs.first() == Some(&0xa0) {
        tbs = element(tbs, 0xa0)?.1;
    }
    for tag in [0x02, 0x30, 0x30] {
        tbs = element(tbs, tag)?.1;
    }
    let (validity, _) = element(tbs, 0x30)?;
    let (not_before, rest) = time(validity)?;
    let (not_after, _) = time(rest)?;
    Some(Validity {
        not_before,
        not_after,
    })
}

/// The contents of the DER element of `tag` at the start of `der`, and
/// what follows it.
fn element(der: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    let (&found, rest) = der.split_first()?;
    if found != tag {
        return None;
    }
    let (&first, rest) = rest.split_first()?;
    let (length, rest) = match first {
        0..=0x7f => (usize::from(first), rest),
        0x81..=0x84 => {
            let bytes = usize::from(first & 0x7f);
            let (length, rest) = (rest.get(..bytes)?, rest.get(bytes..)?);
            let length = length
                .iter()
                .fold(0usize, |n, &b| (n << 8) | usize::from(b));
            (length, rest)
        }
        _ => return None,
    };
    Some((rest.get(..length)?, rest.get(length..)?))
}

/// A UTCTime (`YYMMDDHHMMSSZ`, years 1950 to 2049) or GeneralizedTime
/// (`YYYYMMDDHHMMSSZ`) at the start of `der`, in seconds since the epoch,
/// and what follows it.
fn time(der: &[u8]) -> Option<(i64, &[u8])> {
    let (text, rest, year) = match der.first()? {
        0x17 => {
            let (text, rest) = element(der, 0x17)?;
            let yy = digits(text.get(..2)?)?;
            (
                text.get(2..)?,
                rest,
                if yy >= 50 { 1900 + yy } else { 2000 + yy },
            )
        }
        0x18 => {
            let (text, rest) = element(der, 0x18)?;
            (text.get(4..)?, rest, digits(text.get(..4)?)?)
        }
        _ => return None,
    };
    if text.len() != 11 || text[10] != b'Z' {
        return None;
    }
    let field = |at: usize| digits(&text[at..at + 2]);
    let (month, day) = (field(0)?, field(2)?);
    let (hour, minute, second) = (field(4)?, field(6)?, field(8)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) {
        return None;
    }
    let days = days_from_civil(year, month, day);
    Some((days * 86_400 + hour * 3_600 + minute * 60 + second, rest))
}

fn digits(text: &[u8]) -> Option<i64> {
    text.iter().try_fold(0i64, |n, &b| {
        b.is_ascii_digit().then(|| n * 10 + i64::from(b - b'0'))
    })
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let month_from_march = (month + 9) % 12;
    let day_of_year = (153 * month_from_march + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// `seconds` since the epoch as an RFC 3339 UTC time, for messages.
fn rfc3339(seconds: i64) -> String {
    let days = seconds.div_euclid(86_400);
    let of_day = seconds.rem_euclid(86_400);
    // Hinnant's `civil_from_days`.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z - era * 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        of_day / 3_600,
        of_day % 3_600 / 60,
        of_day % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A DER element of `tag` holding `contents`.
    fn der(tag: u8, contents: &[u8]) -> Vec<u8> {
        let mut out = vec![tag];
        match contents.len() {
            n @ 0..=0x7f => out.push(n as u8),
            n => out.extend([0x82, (n >> 8) as u8, n as u8]),
        }
        out.extend_from_slice(contents);
        out
    }

    /// A certificate shaped enough for [`of_certificate`].
    fn certificate(not_before: &[u8], not_after: &[u8]) -> Vec<u8> {
        let tbs = [
            der(0xa0, &der(0x02, &[2])),
            der(0x02, &[1, 2, 3]),
            der(0x30, &der(0x06, &[42])),
            der(0x30, &[0u8; 200]),
            der(0x30, &[not_before, not_after].concat()),
            der(0x30, &[]),
        ]
        .concat();
        der(
            0x30,
            &[der(0x30, &tbs), der(0x30, &[]), der(0x03, &[0])].concat(),
        )
    }

    #[test]
    fn both_time_forms_are_read() {
        let cert = certificate(&der(0x17, b"260101000000Z"), &der(0x18, b"20500102030405Z"));
        let validity = of_certificate(&cert).expect("read");
        assert_eq!(rfc3339(validity.not_before), "2026-01-01T00:00:00Z");
        assert_eq!(rfc3339(validity.not_after), "2050-01-02T03:04:05Z");
        assert_eq!(validity.not_before, 1_767_225_600);
        let old = certificate(&der(0x17, b"991231235959Z"), &der(0x17, b"000229000000Z"));
        let old = of_certificate(&old).expect("read");
        assert_eq!(rfc3339(old.not_before), "1999-12-31T23:59:59Z");
        assert_eq!(rfc3339(old.not_after), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn dates_outside_say_why() {
        let validity = Validity {
            not_before: 1_000,
            not_after: 2_000,
        };
        assert_eq!(validity.not_valid_at(1_500), None);
        assert_eq!(
            validity.not_valid_at(999).as_deref(),
            Some("not valid before 1970-01-01T00:16:40Z")
        );
        assert_eq!(
            validity.not_valid_at(2_001).as_deref(),
            Some("expired at 1970-01-01T00:33:20Z")
        );
    }

    #[test]
    fn what_is_not_a_certificate_reads_as_none() {
        assert_eq!(of_certificate(b""), None);
        assert_eq!(of_certificate(&[0x30, 0x85, 1, 2, 3]), None);
        let bad_time = certificate(&der(0x17, b"26010100000Z"), &der(0x17, b"260101000000Z"));
        assert_eq!(of_certificate(&bad_time), None);
        let cut = certificate(&der(0x17, b"260101000000Z"), &der(0x17, b"260101000000Z"));
        assert_eq!(of_certificate(&cut[..cut.len() - 3]), None);
    }
}
